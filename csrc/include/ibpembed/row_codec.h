// SPDX-License-Identifier: Apache-2.0
//
// Encode and decode one row of the compact layout (see format.h), templated on the chunk width W
// and on the bit-op policy (PortableBitOps here; Bmi2BitOps on BMI2 hosts). The same functions
// run in the CPU codec and, compiled by nvcc, in tests of the device arithmetic.
#pragma once

#include <cstdint>

#include "ibpembed/bits.h"
#include "ibpembed/format.h"

namespace ibpembed {

// Bits a participating chunk stores at position j.
template <int W>
IBP_HD int free_bits(uint64_t mask) {
  return W - popcount64(mask & low_bits(W));
}

// Per position, the bits a participating chunk stores (k_j = W - popcount(mask[j])). Row loops
// take these precomputed: they are per-table constants.
template <int W>
IBP_HD void compute_free_bits(const uint64_t* mask, int num_chunks, uint8_t* free) {
  for (int j = 0; j < num_chunks; ++j) free[j] = static_cast<uint8_t>(free_bits<W>(mask[j]));
}

// Byte size of the row's compressed encoding (header + payload), before slot rounding.
// free[j] = k_j (compute_free_bits).
template <int W>
IBP_HD int64_t compressed_row_bytes(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                                    const uint64_t* bitval, const uint8_t* free, int num_chunks) {
  int64_t bits = num_chunks;
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    bits += ((x & mask[j]) == bitval[j]) ? free[j] : W;
  }
  return (bits + 7) >> 3;
}

// Writes the compressed encoding into `out`, which must be zeroed and hold
// compressed_row_bytes(...) + 9 bytes.
template <int W, class Ops>
IBP_HD void encode_row(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                       const uint64_t* bitval, const uint8_t* free, int num_chunks,
                       uint8_t* out) {
  uint64_t pos = static_cast<uint64_t>(num_chunks);
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    if ((x & mask[j]) == bitval[j]) {
      out[j >> 3] |= static_cast<uint8_t>(1u << (j & 7));
      const int len = free[j];
      write_stream_bits(out, pos, Ops::extract(x, ~mask[j] & low_bits(W)), len);
      pos += len;
    } else {
      write_stream_bits(out, pos, x, W);
      pos += W;
    }
  }
}

// One chunk of a compressed row, without a branch: `bits` holds the stream from the chunk's
// offset (at least W valid bits), `participates` is its header bit (0 or 1). A participating chunk
// is bitval | deposit(bits, ~mask); any other chunk is its W stored bits, which is the same
// deposit with an all-ones mask. Participation is data-dependent: a mispredicted branch would cost
// more than the deposit.
template <int W, class Ops>
IBP_HD uint64_t decode_chunk(uint64_t bits, uint64_t participates, uint64_t free_mask,
                             uint64_t bitval) {
  const uint64_t select = 0 - participates;  // all ones when participating
  return (bitval & select) | Ops::deposit(bits, (free_mask | ~select) & low_bits(W));
}

// Stream bits the chunk occupies: k_j when participating, else W.
template <int W>
IBP_HD uint64_t chunk_stream_bits(uint64_t participates, uint64_t free_count) {
  return W - ((W - free_count) & (0 - participates));
}

// Decodes a compressed row into row_bytes bytes. Reads up to 9 bytes past the encoding.
// free[j] = k_j from compute_free_bits. The CPU fast path (csrc/codec) and the GPU kernels
// schedule this differently but share decode_chunk.
template <int W, class Ops>
IBP_HD void decode_row(const uint8_t* in, const uint64_t* mask, const uint64_t* bitval,
                       const uint8_t* free, int num_chunks, int64_t row_bytes, uint8_t* row) {
  uint64_t pos = static_cast<uint64_t>(num_chunks);
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t participates = (in[j >> 3] >> (j & 7)) & 1;
    const uint64_t x = decode_chunk<W, Ops>(read_stream_bits<W>(in, pos), participates,
                                            ~mask[j] & low_bits(W), bitval[j]);
    pos += chunk_stream_bits<W>(participates, free[j]);
    store_chunk<W>(row, row_bytes, j, x);
  }
}

}  // namespace ibpembed
