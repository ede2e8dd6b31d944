// SPDX-License-Identifier: Apache-2.0
//
// Row kernels of one CPU path, templated on the bit-op policy. Included by exactly one .cpp per
// path (row_kernels_ref.cpp, row_kernels_bmi2.cpp), each inside its own anonymous namespace so
// the BMI2 instantiations keep internal linkage and never leak into the reference path.
#pragma once

#include <cstring>

#include "ibpembed/codec.h"
#include "ibpembed/row_codec.h"

namespace ibpembed::detail {
namespace {

// How far ahead of the row being decoded the gather loop touches: the index entries at twice
// this distance, the payload lines at this distance. DRAM latency over a ~100 ns row decode.
inline constexpr int64_t kPrefetchRows = 8;

inline void prefetch_index(const TableView& t, int64_t r) {
  __builtin_prefetch(t.row_units + r, 0, 1);
  __builtin_prefetch(t.block_base + r / kRowsPerBlock, 0, 1);
}

inline void prefetch_row(const TableView& t, int64_t r) {
  const int64_t offset = row_offset(t, r);
  const int64_t bytes = t.unit_bytes * t.row_units[r];
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(t.payload + offset + line, 0, 0);
}

template <class Ops>
int64_t compressed_bytes(const uint8_t* row, int64_t row_bytes, const uint64_t* mask,
                         const uint64_t* bitval, int chunk_bits) {
  const int v = chunks_per_row(row_bytes, chunk_bits);
  switch (chunk_bits) {
    case 16: return compressed_row_bytes<16>(row, row_bytes, mask, bitval, v);
    case 32: return compressed_row_bytes<32>(row, row_bytes, mask, bitval, v);
    default: return compressed_row_bytes<64>(row, row_bytes, mask, bitval, v);
  }
}

template <class Ops>
void encode(const uint8_t* row, int64_t row_bytes, const uint64_t* mask, const uint64_t* bitval,
            int chunk_bits, uint8_t* out) {
  const int v = chunks_per_row(row_bytes, chunk_bits);
  switch (chunk_bits) {
    case 16: return encode_row<16, Ops>(row, row_bytes, mask, bitval, v, out);
    case 32: return encode_row<32, Ops>(row, row_bytes, mask, bitval, v, out);
    default: return encode_row<64, Ops>(row, row_bytes, mask, bitval, v, out);
  }
}

template <int W, class Ops>
void decode_rows_w(const TableView& t, const int64_t* ids, int64_t n, int64_t lookahead,
                   uint8_t* out) {
  const int64_t visible = n + lookahead;
  for (int64_t i = 0; i < n; ++i) {
    if (i + 2 * kPrefetchRows < visible) prefetch_index(t, ids[i + 2 * kPrefetchRows]);
    if (i + kPrefetchRows < visible) prefetch_row(t, ids[i + kPrefetchRows]);
    const int64_t r = ids[i];
    const uint8_t* src = t.payload + row_offset(t, r);
    uint8_t* dst = out + i * t.row_bytes;
    if (row_is_compressed(t, r)) {
      decode_row<W, Ops>(src, t.mask, t.bitval, t.num_chunks, t.row_bytes, dst);
    } else {
      std::memcpy(dst, src, static_cast<size_t>(t.row_bytes));
    }
  }
}

template <class Ops>
void decode_rows(const TableView& t, const int64_t* ids, int64_t n, int64_t lookahead,
                 uint8_t* out) {
  switch (t.chunk_bits) {
    case 16: return decode_rows_w<16, Ops>(t, ids, n, lookahead, out);
    case 32: return decode_rows_w<32, Ops>(t, ids, n, lookahead, out);
    default: return decode_rows_w<64, Ops>(t, ids, n, lookahead, out);
  }
}

template <class Ops>
RowKernels make_row_kernels() {
  return RowKernels{&compressed_bytes<Ops>, &encode<Ops>, &decode_rows<Ops>};
}

}  // namespace
}  // namespace ibpembed::detail
