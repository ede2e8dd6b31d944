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

// Code of chunk x at a position with codebook `patterns` (K entries): the first k whose pattern
// matches the masked bits, or the escape code 0. Codebooks are ordered most frequent first, so
// the scan usually stops at once.
IBP_HD int chunk_code(uint64_t x, uint64_t mask, const uint64_t* patterns, int k) {
  const uint64_t masked = x & mask;
  for (int i = 0; i < k; ++i) {
    if (masked == patterns[i]) return i + 1;
  }
  return 0;
}

// Whether chunk x takes a code other than the escape, without chunk_code's early exit: sizing
// only needs this bit, and on trained tables it is too irregular to branch on.
IBP_HD bool chunk_has_code(uint64_t x, uint64_t mask, const uint64_t* patterns, int k) {
  const uint64_t masked = x & mask;
  bool any = false;
  for (int i = 0; i < k; ++i) any |= masked == patterns[i];
  return any;
}

// Byte size of the row's compressed encoding (codes + free fields + exceptions), before slot
// rounding. free[j] = k_j (compute_free_bits).
template <int W>
IBP_HD int64_t compressed_row_bytes(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                                    const uint64_t* bitval, int code_bits, const uint8_t* free,
                                    int num_chunks) {
  const int k = codebook_size(code_bits);
  int64_t bits = static_cast<int64_t>(num_chunks) * code_bits;
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    bits += chunk_has_code(x, mask[j], bitval + static_cast<int64_t>(j) * k, k) ? free[j] : W;
  }
  return (bits + 7) >> 3;
}

// Stream bit where the exception area starts: V * C + sum_j k_j.
IBP_HD uint64_t exception_start(const uint8_t* free, int num_chunks, int code_bits) {
  uint64_t start = static_cast<uint64_t>(num_chunks) * static_cast<uint64_t>(code_bits);
  for (int j = 0; j < num_chunks; ++j) start += free[j];
  return start;
}

// Writes the compressed encoding into `out`, which must be zeroed and hold
// compressed_row_bytes(...) + 9 bytes, and returns its size, compressed_row_bytes(...). Bytes of
// `out` past that size stay zero.
template <int W, class Ops>
IBP_HD int64_t encode_row(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                          const uint64_t* bitval, int code_bits, const uint8_t* free,
                          int num_chunks, uint8_t* out) {
  const int k = codebook_size(code_bits);
  uint64_t field = static_cast<uint64_t>(num_chunks) * static_cast<uint64_t>(code_bits);
  uint64_t exception = exception_start(free, num_chunks, code_bits);
  for (int j = 0; j < num_chunks; ++j) {
    const uint64_t x = load_chunk<W>(row, row_bytes, j);
    write_stream_bits(out, field, Ops::extract(x, ~mask[j] & low_bits(W)), free[j]);
    field += free[j];
    const int code = chunk_code(x, mask[j], bitval + static_cast<int64_t>(j) * k, k);
    write_stream_bits(out, static_cast<uint64_t>(j) * code_bits, static_cast<uint64_t>(code),
                      code_bits);
    if (code == 0) {
      write_stream_bits(out, exception, Ops::extract(x, mask[j]), W - free[j]);
      exception += W - free[j];
    }
  }
  return static_cast<int64_t>((exception + 7) >> 3);
}

// Code of chunk j of an encoded row.
IBP_HD int read_code(const uint8_t* in, int j, int code_bits) {
  return static_cast<int>(read_stream_bits<8>(in, static_cast<uint64_t>(j) * code_bits) &
                          low_bits(code_bits));
}

// A chunk from its free field (at least k_j valid bits from the field's offset), as if it
// participates.
template <class Ops>
IBP_HD uint64_t decode_field(uint64_t field_bits, uint64_t free_mask, uint64_t bitval) {
  return bitval | Ops::deposit(field_bits, free_mask);
}

// A non-participating chunk: replace the assumed invariant bits with its stored exception bits.
template <class Ops>
IBP_HD uint64_t patch_exception(uint64_t chunk, uint64_t exception_bits, uint64_t mask) {
  return (chunk & ~mask) | Ops::deposit(exception_bits, mask);
}

// Decodes a compressed row into row_bytes bytes, chunk after chunk: the plain statement of the
// format (the CPU fast path and the GPU kernels schedule the same decode_field/patch_exception
// differently). free[j] = k_j. Reads up to 9 bytes past the encoding.
template <int W, class Ops>
IBP_HD void decode_row(const uint8_t* in, const uint64_t* mask, const uint64_t* bitval,
                       int code_bits, const uint8_t* free, int num_chunks, int64_t row_bytes,
                       uint8_t* row) {
  const int k = codebook_size(code_bits);
  uint64_t field = static_cast<uint64_t>(num_chunks) * static_cast<uint64_t>(code_bits);
  uint64_t exception = exception_start(free, num_chunks, code_bits);
  for (int j = 0; j < num_chunks; ++j) {
    const int code = read_code(in, j, code_bits);
    const uint64_t pattern = code != 0 ? bitval[static_cast<int64_t>(j) * k + code - 1] : 0;
    uint64_t x = decode_field<Ops>(read_stream_bits<W>(in, field), ~mask[j] & low_bits(W), pattern);
    field += free[j];
    if (code == 0) {
      x = patch_exception<Ops>(x, read_stream_bits<W>(in, exception), mask[j]);
      exception += W - free[j];
    }
    store_chunk<W>(row, row_bytes, j, x);
  }
}

}  // namespace ibpembed
