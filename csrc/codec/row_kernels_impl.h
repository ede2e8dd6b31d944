// SPDX-License-Identifier: Apache-2.0
//
// Row kernels of one CPU path, templated on the bit-op policy. Included by exactly one .cpp per
// path (row_kernels_ref.cpp, row_kernels_bmi2.cpp), each inside its own anonymous namespace so
// the BMI2 instantiations keep internal linkage and never leak into the reference path.
#pragma once

#include <cstring>
#include <vector>

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

template <int W>
std::vector<uint8_t> free_counts(const uint64_t* mask, int num_chunks) {
  std::vector<uint8_t> free(num_chunks);
  compute_free_bits<W>(mask, num_chunks, free.data());
  return free;
}

template <int W>
void size_rows_w(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                 const uint64_t* bitval, int64_t* comp_bytes) {
  const int v = chunks_per_row(row_bytes, W);
  const std::vector<uint8_t> free = free_counts<W>(mask, v);
  for (int64_t r = 0; r < n; ++r) {
    comp_bytes[r] = compressed_row_bytes<W>(rows + r * row_bytes, row_bytes, mask, bitval,
                                            free.data(), v);
  }
}

template <class Ops>
void size_rows(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
               const uint64_t* bitval, int chunk_bits, int64_t* comp_bytes) {
  switch (chunk_bits) {
    case 16: return size_rows_w<16>(rows, n, row_bytes, mask, bitval, comp_bytes);
    case 32: return size_rows_w<32>(rows, n, row_bytes, mask, bitval, comp_bytes);
    default: return size_rows_w<64>(rows, n, row_bytes, mask, bitval, comp_bytes);
  }
}

template <int W, class Ops>
void encode_rows_w(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                   const uint64_t* bitval, const uint8_t* compressed, const int64_t* offsets,
                   uint8_t* payload) {
  const int v = chunks_per_row(row_bytes, W);
  const std::vector<uint8_t> free = free_counts<W>(mask, v);
  // Encoding ORs bits into a zeroed scratch row with write slack, then copies only the encoded
  // bytes: neighbouring slots (possibly written by other threads) are never touched.
  std::vector<uint8_t> scratch(static_cast<size_t>(row_bytes) + 64);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* dst = payload + offsets[r];
    if (!compressed[r]) {
      std::memcpy(dst, row, static_cast<size_t>(row_bytes));
      continue;
    }
    // A row is only encoded when it shrinks, so its encoding is < row_bytes.
    const int64_t bytes = compressed_row_bytes<W>(row, row_bytes, mask, bitval, free.data(), v);
    std::memset(scratch.data(), 0, static_cast<size_t>(bytes) + 16);
    encode_row<W, Ops>(row, row_bytes, mask, bitval, free.data(), v, scratch.data());
    std::memcpy(dst, scratch.data(), static_cast<size_t>(bytes));
  }
}

template <class Ops>
void encode_rows(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                 const uint64_t* bitval, int chunk_bits, const uint8_t* compressed,
                 const int64_t* offsets, uint8_t* payload) {
  switch (chunk_bits) {
    case 16:
      return encode_rows_w<16, Ops>(rows, n, row_bytes, mask, bitval, compressed, offsets,
                                    payload);
    case 32:
      return encode_rows_w<32, Ops>(rows, n, row_bytes, mask, bitval, compressed, offsets,
                                    payload);
    default:
      return encode_rows_w<64, Ops>(rows, n, row_bytes, mask, bitval, compressed, offsets,
                                    payload);
  }
}

// Per-table constants of the decode loops, computed once per decode_rows call.
template <int W>
struct DecodePlan {
  std::vector<uint64_t> free_mask;  // ~mask[j] within W bits
  std::vector<uint64_t> bitval;
  std::vector<uint8_t> free_count;  // k_j
  // Stream bit offset of chunk j when every chunk participates (the common case for tables
  // with truly invariant bits): such rows decode with no serial dependency between chunks.
  std::vector<uint32_t> packed_offset;

  explicit DecodePlan(const TableView& t)
      : free_mask(t.num_chunks), bitval(t.bitval, t.bitval + t.num_chunks),
        free_count(t.num_chunks), packed_offset(t.num_chunks) {
    uint32_t pos = static_cast<uint32_t>(t.num_chunks);
    for (int j = 0; j < t.num_chunks; ++j) {
      free_mask[j] = ~t.mask[j] & low_bits(W);
      free_count[j] = static_cast<uint8_t>(popcount64(free_mask[j]));
      packed_offset[j] = pos;
      pos += free_count[j];
    }
  }
};

inline bool all_chunks_participate(const uint8_t* header, int num_chunks) {
  int j = 0;
  for (; j + 64 <= num_chunks; j += 64) {
    uint64_t word;
    std::memcpy(&word, header + j / 8, 8);
    if (word != ~uint64_t{0}) return false;
  }
  for (; j < num_chunks; ++j) {
    if (!((header[j >> 3] >> (j & 7)) & 1)) return false;
  }
  return true;
}

template <int W, class Ops>
void decode_packed_row(const DecodePlan<W>& plan, const uint8_t* in, int whole_chunks,
                       uint8_t* row) {
  constexpr int S = W / 8;
  for (int j = 0; j < whole_chunks; ++j) {
    const uint64_t bits = read_stream_bits<W>(in, plan.packed_offset[j]);
    const uint64_t x = plan.bitval[j] | Ops::deposit(bits, plan.free_mask[j]);
    std::memcpy(row + static_cast<int64_t>(j) * S, &x, S);
  }
}

template <int W, class Ops>
void decode_mixed_row(const DecodePlan<W>& plan, const uint8_t* in, int num_chunks,
                      int whole_chunks, uint8_t* row) {
  constexpr int S = W / 8;
  uint64_t pos = static_cast<uint64_t>(num_chunks);
  uint64_t header = 0;
  for (int j = 0; j < whole_chunks; ++j) {
    if ((j & 63) == 0) std::memcpy(&header, in + j / 8, 8);  // bits past V are never used
    const uint64_t participates = header & 1;
    header >>= 1;
    const uint64_t x = decode_chunk<W, Ops>(read_stream_bits<W>(in, pos), participates,
                                            plan.free_mask[j], plan.bitval[j]);
    pos += chunk_stream_bits<W>(participates, plan.free_count[j]);
    std::memcpy(row + static_cast<int64_t>(j) * S, &x, S);
  }
}

template <int W, class Ops>
void decode_rows_w(const TableView& t, const int64_t* ids, int64_t n, int64_t lookahead,
                   uint8_t* out) {
  constexpr int S = W / 8;
  const DecodePlan<W> plan(t);
  const int whole_chunks = static_cast<int>(t.row_bytes / S);
  const bool has_tail = whole_chunks < t.num_chunks;
  const int64_t visible = n + lookahead;
  for (int64_t i = 0; i < n; ++i) {
    if (i + 2 * kPrefetchRows < visible) prefetch_index(t, ids[i + 2 * kPrefetchRows]);
    if (i + kPrefetchRows < visible) prefetch_row(t, ids[i + kPrefetchRows]);
    const int64_t r = ids[i];
    const uint8_t* src = t.payload + row_offset(t, r);
    uint8_t* dst = out + i * t.row_bytes;
    if (!row_is_compressed(t, r)) {
      std::memcpy(dst, src, static_cast<size_t>(t.row_bytes));
    } else if (has_tail) {
      // Rows whose width is not a multiple of the chunk: the plain per-chunk loop, which
      // stores the partial last chunk.
      decode_row<W, Ops>(src, t.mask, t.bitval, plan.free_count.data(), t.num_chunks,
                         t.row_bytes, dst);
    } else if (all_chunks_participate(src, t.num_chunks)) {
      decode_packed_row<W, Ops>(plan, src, whole_chunks, dst);
    } else {
      decode_mixed_row<W, Ops>(plan, src, t.num_chunks, whole_chunks, dst);
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
  return RowKernels{&size_rows<Ops>, &encode_rows<Ops>, &decode_rows<Ops>};
}

}  // namespace
}  // namespace ibpembed::detail
