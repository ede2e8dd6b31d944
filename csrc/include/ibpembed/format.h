// SPDX-License-Identifier: Apache-2.0
//
// The ibpembed compact table layout (format version 3). Torch-free: this header is compiled by
// g++ for the CPU codec and by nvcc for the CUDA kernels, so both read the very same index math.
// Version 2 is version 3 with C = 1 (below), byte for byte; version 1 stored non-participating
// chunks inline and was never released.
//
// A table has N rows of R bytes. It is cut into chunks of W bits (W in {16, 32, 64}, S = W / 8
// bytes), V = ceil(R / S) chunks per row; a row whose width is not a multiple of S is read as if
// zero-padded to V * S bytes (the padding bits are always zero, so the fit makes them invariant and
// they cost nothing). Chunks are little-endian W-bit integers.
//
// Per table a code width C in {1, 2, 3, 4} and K = 2^C - 1. Per chunk position j the table keeps
// mask[j] and a codebook of K patterns bitval[j * K + k - 1] for codes k = 1..K (low W bits of a
// uint64, each with pattern & ~mask[j] == 0). Chunk x of a row gets code k, the smallest k with
// (x & mask[j]) == bitval[j * K + k - 1], or the escape code 0 when no pattern matches; it always
// stores its k_j = W - popcount(mask[j]) free bits pext(x, ~mask[j]). C = 1 is the published IBP:
// one pattern per position (the invariant bit values), code 1 = the chunk participates. C > 1 is
// the exponent-aware mode: the masked bits (mostly exponents) take one of K frequent values.
//
// Compressed row = one LSB-first bit stream (stream bit p is bit p % 8 of byte p / 8):
//   codes        bits [0, V * C): code of chunk j at bit j * C (C bits);
//   free fields  chunk j's free bits pext(x, ~mask[j]) (k_j bits) at bit
//                F_j = V * C + sum_{i<j} k_i, for every chunk, escaped or not;
//   exceptions   from bit E = V * C + sum_j k_j, for each chunk with code 0 in order of j, its
//                W - k_j masked bits pext(x, mask[j]).
// Its byte size is ceil((E + sum over escaped j of (W - k_j)) / 8) bytes. Every free field sits
// at a per-table constant offset, so chunks decode independently
// (bitval[j * K + code - 1] | pdep(field, ~mask)) and only the rare escapes are read in sequence
// and patched in ((x & ~mask) | pdep(exception, mask)). A raw row is the R source bytes verbatim.
//
// Rows are stored back to back in one payload. Each row occupies a *slot* of a whole number of
// units of U bytes (U a power of two, chosen so that a raw slot is at most 255 units), and a row
// is stored compressed iff its compressed slot is strictly smaller than its raw slot.
// Random access uses a 1.25 byte/row index:
//   row_units[r]     uint8, slot size of row r in units (padded with zeros to a multiple of 32);
//   block_base[b]    int64, payload byte offset of row 32 * b (one extra entry: payload end);
//   offset(r) = block_base[r / 32] + U * sum(row_units[32 * (r / 32) .. r - 1]).
// Only a block's start comes from block_base: a slot's length comes from row_units alone. Blocks
// are in payload order in a freshly compressed table and in files, but the table store's
// update_rows re-encodes a block into a spare area past the payload end, after which block_base
// is no longer sorted (the last entry is then the largest slot end). Never derive a block's size
// from neighbouring bases.
// The compressed bitmask has one bit per row (bit r % 32 of int32 word r / 32, set = compressed).
// It is redundant with the slot sizes (files are checked for agreement): the GPU kernels read it
// from device memory, the CPU decoders compare the slot size instead.
// The payload carries kPayloadPad zero bytes past its end so decoders may read 8 bytes ahead.
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(__CUDACC__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__CUDACC__)
#define IBP_HD __host__ __device__ __forceinline__
#define IBP_HD_METHOD __host__ __device__ __forceinline__
#else
// NOTE(codec): internal linkage on the host. Every translation unit keeps its own copies of these
// helpers, so the linker can never pick the copy compiled with -mbmi2 for code that runs on a
// CPU without BMI2.
#define IBP_HD static inline
#define IBP_HD_METHOD inline
#endif

namespace ibpembed {

inline constexpr uint32_t kFormatVersion = 3;
inline constexpr int kMaxCodeBits = 4;
inline constexpr int kRowsPerBlock = 32;
inline constexpr int kMaxUnitsPerRow = 255;
inline constexpr int kPayloadPad = 16;
// 64 KiB rows (16384 fp32 elements): far beyond any embedding dim, and small enough that per-chunk
// scratch fits on a thread's stack.
inline constexpr int kMaxRowBytes = 1 << 16;

// Element type of a table, as stored. Rows are bits to the codec; the dtype matters only to
// pooled lookups, which accumulate in fp32.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kUInt8 = 3,  // plain bytes: gather/decompress only
  kInt8 = 4,   // plain bytes: gather/decompress only
  // fbgemm row-wise int8 (IntNBitTableBatchedEmbeddingBagsCodegen, SparseType.INT8): each row is
  // a 4-byte header (fp16 scale, fp16 bias) followed by D uint8 codes; value = code * scale + bias.
  kInt8Rowwise = 5,
};

enum class Pooling : int32_t { kSum = 0, kMean = 1 };

IBP_HD int chunk_bytes(int chunk_bits) { return chunk_bits / 8; }

IBP_HD int chunks_per_row(int64_t row_bytes, int chunk_bits) {
  const int s = chunk_bytes(chunk_bits);
  return static_cast<int>((row_bytes + s - 1) / s);
}

IBP_HD constexpr uint64_t low_bits(int w) {
  return w >= 64 ? ~uint64_t{0} : ((uint64_t{1} << w) - 1);
}

// Largest slot unit (alignment) a table may use: far past any useful alignment, and it bounds
// the loop below for any min_align a caller passes.
inline constexpr int64_t kMaxSlotUnit = int64_t{1} << 16;

// Smallest power-of-two unit >= min_align for which a raw row fits in kMaxUnitsPerRow units
// (capped at kMaxSlotUnit: callers reject a min_align above it).
IBP_HD int64_t slot_unit_bytes(int64_t row_bytes, int64_t min_align) {
  int64_t unit = 1;
  while (unit < min_align && unit < kMaxSlotUnit) unit <<= 1;
  while ((row_bytes + unit - 1) / unit > kMaxUnitsPerRow) unit <<= 1;
  return unit;
}

IBP_HD int64_t units_for(int64_t bytes, int64_t unit) { return (bytes + unit - 1) / unit; }

IBP_HD int64_t num_blocks(int64_t num_rows) {
  return (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
}

#if !defined(__CUDACC__) && defined(__SSE2__)
// 32 bytes of 0xFF then 32 zero bytes: the 32 bytes at kPrefixBytes + 32 - n keep the first n.
alignas(64) inline constexpr uint8_t kPrefixBytes[64] = {
    0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
    0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF};
#endif

// Sum of the first n (< 32) bytes of a 32-byte block: the slot offset of row n of a block.
IBP_HD uint32_t sum_first_bytes(const uint8_t* block, int n) {
#if !defined(__CUDACC__) && defined(__SSE2__)
  // NOTE(codec): every lookup locates its row through this sum, and n is as random as the ids:
  // the SWAR loop below branches on n and mispredicts on most rows. psadbw (SSE2, part of
  // x86-64) sums the masked bytes without a branch.
  const __m128i lo =
      _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)),
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(kPrefixBytes + 32 - n)));
  const __m128i hi =
      _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)),
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(kPrefixBytes + 48 - n)));
  const __m128i sums =
      _mm_add_epi64(_mm_sad_epu8(lo, _mm_setzero_si128()), _mm_sad_epu8(hi, _mm_setzero_si128()));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(sums) +
                               _mm_cvtsi128_si32(_mm_unpackhi_epi64(sums, sums)));
#else
  // SWAR, for the device (and hosts without SSE2).
  uint32_t total = 0;
  for (int w = 0; w < 4 && n > 0; ++w, n -= 8) {
    uint64_t v;
    memcpy(&v, block + 8 * w, 8);
    if (n < 8) v &= (uint64_t{1} << (8 * n)) - 1;
    // Pairwise byte sums into 16-bit lanes (max 510 each), then one multiply folds the lanes.
    v = (v & 0x00FF00FF00FF00FFull) + ((v >> 8) & 0x00FF00FF00FF00FFull);
    total += static_cast<uint32_t>((v * 0x0001000100010001ull) >> 48);
  }
  return total;
#endif
}

// Non-owning view of a compressed table: everything a decoder needs, as raw pointers.
struct TableView {
  const uint8_t* payload;     // slots back to back, kPayloadPad readable bytes past the end
  const int64_t* block_base;  // [num_blocks + 1]
  const uint8_t* row_units;   // [num_blocks * 32]
  const int32_t* bitmask;     // [ceil(N / 32)]
  const uint64_t* mask;       // [V]
  const uint64_t* bitval;     // [V * K] codebooks, K = 2^code_bits - 1
  int64_t num_rows;
  int64_t row_bytes;
  int64_t unit_bytes;
  int chunk_bits;
  int num_chunks;
  int code_bits;  // C
  // Optional decoded tier (CPU lookups only; null when the table has none): rows held decoded at
  // a fixed stride, in row order, which lookups read in place of the payload, found without the
  // index. tier_dir is a rank directory of two words per 64 rows: a bit per row (set = in the
  // tier), then the number of tier rows before the word, so row r sits at tier row
  // count + popcount(lower bits). A null tier_dir with tier_rows set means every row, row r at
  // tier row r (a tier of all rows, or an all-raw table's own payload).
  const uint64_t* tier_dir = nullptr;  // [ceil(N / 64) * 2] or null
  const uint8_t* tier_rows = nullptr;  // [tier_num_rows, tier_stride]
  int64_t tier_stride = 0;             // >= row_bytes
  int64_t tier_num_rows = 0;
};

// K, the patterns per position of a C-bit code (code 0 is the escape).
IBP_HD int codebook_size(int code_bits) { return (1 << code_bits) - 1; }

// The code width of a table from its codebook length, 0 if the length is not V * (2^C - 1) for
// a C in [1, kMaxCodeBits].
IBP_HD int code_bits_for(int64_t codebook_entries, int num_chunks) {
  for (int c = 1; c <= kMaxCodeBits; ++c) {
    if (codebook_entries == static_cast<int64_t>(num_chunks) * codebook_size(c)) return c;
  }
  return 0;
}

IBP_HD bool row_is_compressed(const TableView& t, int64_t r) {
  return (static_cast<uint32_t>(t.bitmask[r >> 5]) >> (r & 31)) & 1u;
}

IBP_HD int64_t row_offset(const TableView& t, int64_t r) {
  const int64_t b = r / kRowsPerBlock;
  const int in_block = static_cast<int>(r - b * kRowsPerBlock);
  return t.block_base[b] +
         t.unit_bytes * sum_first_bytes(t.row_units + b * kRowsPerBlock, in_block);
}

}  // namespace ibpembed
