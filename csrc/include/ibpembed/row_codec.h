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

// Byte size of the row's compressed encoding (header + payload), before slot rounding.
template <int W>
IBP_HD int64_t compressed_row_bytes(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                                    const uint64_t* bitval, int num_chunks) {
  int64_t bits = num_chunks;
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    bits += ((x & mask[j]) == bitval[j]) ? free_bits<W>(mask[j]) : W;
  }
  return (bits + 7) >> 3;
}

// Writes the compressed encoding into `out`, which must be zeroed and hold
// compressed_row_bytes(...) + 9 bytes.
template <int W, class Ops>
IBP_HD void encode_row(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                       const uint64_t* bitval, int num_chunks, uint8_t* out) {
  uint64_t pos = static_cast<uint64_t>(num_chunks);
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    if ((x & mask[j]) == bitval[j]) {
      out[j >> 3] |= static_cast<uint8_t>(1u << (j & 7));
      const int len = free_bits<W>(mask[j]);
      write_stream_bits(out, pos, Ops::extract(x, ~mask[j] & low_bits(W)), len);
      pos += len;
    } else {
      write_stream_bits(out, pos, x, W);
      pos += W;
    }
  }
}

// Decodes a compressed row into row_bytes bytes. Reads up to 9 bytes past the encoding.
template <int W, class Ops>
IBP_HD void decode_row(const uint8_t* in, const uint64_t* mask, const uint64_t* bitval,
                       int num_chunks, int64_t row_bytes, uint8_t* row) {
  constexpr uint64_t kFull = low_bits(W);
  uint64_t pos = static_cast<uint64_t>(num_chunks);
  for (int j = 0; j < num_chunks; ++j) {
    const bool participates = (in[j >> 3] >> (j & 7)) & 1;
    const uint64_t bits = read_stream_bits<W>(in, pos);
    const uint64_t free_mask = ~mask[j] & kFull;
    uint64_t x;
    if (participates) {
      // deposit() consumes only popcount(free_mask) low bits: no need to trim `bits`.
      x = bitval[j] | Ops::deposit(bits, free_mask);
      pos += popcount64(free_mask);
    } else {
      x = bits & kFull;
      pos += W;
    }
    store_chunk<W>(row, row_bytes, j, x);
  }
}

}  // namespace ibpembed
