// SPDX-License-Identifier: Apache-2.0
//
// Lane-level arithmetic of the CUDA decode kernels: where a row's slot lies, which 16-byte window
// a warp stages, how a lane finds and decodes its chunk. Everything here is __host__ __device__
// and free of warp collectives, so tests/cuda/warp_math_host.cpp runs these very functions with a
// 32-iteration loop standing in for each shuffle, scan and reduction of the kernels. Only the
// collectives themselves (and cp.async) are GPU-only; they live in row_pipeline.cuh.
//
// Decoding a staged compressed row, warp-wide (lane l owns chunk j = 32 g + l of group g), in the
// layout of format.h (V codes of C bits, free fields at per-table offsets, exception area from
// bit E):
//   c     = lane_chunk(...)                  the lane's own code (C bits at stream bit j * C),
//                                            its codebook pattern, free-field and exception
//                                            lengths
//   incl  = inclusive warp scan of pack_lengths(c)   (__shfl_up_sync in the kernel)
//   field = fbase + free part of (incl) - c.free     F_j = V * C + sum_{i<j} k_i
//   exc   = ebase + exception part of (incl) - c.exception
//   x     = lane_decode(..., field, exc, c)  pattern | deposit(field bits, ~mask), then, for an
//                                            escaped chunk (code 0), its exception bits
//                                            deposited into mask
//   fbase, ebase += the group totals (lane 31's incl)
// with fbase = V * C (free_fields_start) and ebase = E = V * C + sum_j k_j (lane_free_bits_sum,
// once per warp) for group 0. Raw rows skip all this: plain copy.
#pragma once

#include <cstdint>

#include "ibpembed/bits.h"
#include "ibpembed/format.h"
#include "ibpembed/row_codec.h"

namespace ibpembed::gpu {

inline constexpr int kWarpSize = 32;
inline constexpr int kVecBytes = 16;

// The 16-byte-aligned byte range [first, first + 16 * vecs) of the payload that covers a slot at
// [offset, offset + bytes); the slot starts `shift` bytes into it. Staging whole aligned vectors
// lets every lane issue full 16-byte loads whatever the slot alignment (unit_bytes may be 1).
struct Window {
  int64_t first;
  int shift;
  int vecs;
};

IBP_HD Window stage_window(int64_t offset, int64_t bytes) {
  const int64_t first = offset & ~int64_t{kVecBytes - 1};
  const int64_t end = (offset + bytes + kVecBytes - 1) & ~int64_t{kVecBytes - 1};
  return Window{first, static_cast<int>(offset - first),
                static_cast<int>((end - first) / kVecBytes)};
}

// Largest slot any row of the table can have: a raw row rounded up to whole units.
IBP_HD int64_t max_slot_bytes(int64_t row_bytes, int64_t unit_bytes) {
  return unit_bytes * units_for(row_bytes, unit_bytes);
}

// Shared memory one staging buffer needs: the widest window (a max slot shifted by up to 15 bytes)
// plus 32 bytes that lane reads may touch past the window (read_staged_bits reads up to 12 bytes
// from its word; a raw row's last chunk may start within the last 7 bytes of the row). Bytes past
// the window are never used, only read.
IBP_HD int64_t stage_buffer_bytes(int64_t row_bytes, int64_t unit_bytes) {
  const int64_t slot = max_slot_bytes(row_bytes, unit_bytes);
  return ((slot + kVecBytes - 1) & ~int64_t{kVecBytes - 1}) + kVecBytes + 2 * kVecBytes;
}

// The term lane `lane` contributes to the offset of row r = 32 b + in_block inside block b: its
// own slot size when it precedes the row. Summed over the warp (__reduce_add_sync in the kernel),
// this is sum(row_units[32 b .. r - 1]), the same quantity format.h's row_offset() computes.
IBP_HD uint32_t units_before_term(uint32_t lane_units, int lane, int in_block) {
  return lane < in_block ? lane_units : 0u;
}

// At least W valid bits (bits above W are garbage) starting at bit `bitpos` of a buffer of 32-bit
// words (LSB-first, like the stream). Word loads only: the buffer is shared memory, and this
// avoids the byte loads a memcpy from an unknown alignment compiles to.
template <int W>
IBP_HD uint64_t read_staged_bits(const uint32_t* words, uint64_t bitpos) {
  const uint64_t i = bitpos >> 5;
  const int shift = static_cast<int>(bitpos & 31);
  const uint64_t lo = static_cast<uint64_t>(words[i]) | (static_cast<uint64_t>(words[i + 1]) << 32);
  uint64_t v = lo >> shift;
  if constexpr (W > 32) {
    // Branch-free: at shift 0 the third word is shifted out entirely.
    v |= (static_cast<uint64_t>(words[i + 2]) << 1) << (63 - shift);
  }
  return v;
}

// Stream bit where the free fields start: after the V codes of C bits (format.h).
IBP_HD uint64_t free_fields_start(int num_chunks, int code_bits) {
  return static_cast<uint64_t>(num_chunks) * static_cast<uint64_t>(code_bits);
}

// Code of chunk j of the slot that starts `shift` bytes into the staging buffer (row_codec.h's
// read_code()). Each lane reads its own: a group's 32 codes span a few consecutive words, so
// lanes load the same word (a broadcast) or neighbouring ones (distinct banks), never a bank
// conflict. Raw rows have no codes and never get here: they take the plain copy path.
IBP_HD int staged_code(const uint32_t* words, int shift, int j, int code_bits) {
  return static_cast<int>(
      read_staged_bits<8>(words, 8 * static_cast<uint64_t>(shift) +
                                     static_cast<uint64_t>(j) * static_cast<uint64_t>(code_bits)) &
      low_bits(code_bits));
}

// What lane `lane` needs to know about its chunk before the scan.
struct LaneChunk {
  int j;              // chunk position
  bool valid;         // j < num_chunks
  bool participates;  // code != 0: no exception bits
  int free;           // k_j, bits of its free field (0 when !valid)
  int exception;      // W - k_j for an escaped chunk (code 0), else 0
  uint64_t mask;      // mask[j] (0 when !valid)
  uint64_t bitval;    // the codebook pattern of its code (0 when escaped or !valid)
};

// Lanes past the last chunk read nothing: in the last group the bits where their codes would be
// are free-field bits, and for a one-group row possibly bytes past the slot.
template <int W>
IBP_HD LaneChunk lane_chunk(const uint32_t* words, int shift, const uint64_t* mask,
                            const uint64_t* bitval, int code_bits, int group, int lane,
                            int num_chunks) {
  LaneChunk c{};
  c.j = 32 * group + lane;
  c.valid = c.j < num_chunks;
  if (!c.valid) return c;
  const int code = staged_code(words, shift, c.j, code_bits);
  c.participates = code != 0;
  c.mask = mask[c.j];
  // A C-bit code is at most K, so a nonzero code always names an entry of the codebook.
  c.bitval =
      c.participates ? bitval[static_cast<int64_t>(c.j) * codebook_size(code_bits) + code - 1] : 0;
  // Bits of a (corrupt) mask above W are ignored here so lengths stay in [0, W] and every read
  // stays in bounds; check_table() reports such masks.
  c.free = W - popcount64(c.mask & low_bits(W));
  c.exception = c.participates ? 0 : W - c.free;
  return c;
}

// Both lengths in one int, so that one warp scan yields the field and the exception offsets
// together: a group's totals are at most 32 * 64 = 2048 each, far below 2^16.
IBP_HD int pack_lengths(const LaneChunk& c) { return c.free | (c.exception << 16); }
IBP_HD int packed_free(int packed) { return packed & 0xFFFF; }
IBP_HD int packed_exception(int packed) { return packed >> 16; }

// This lane's share of sum_j k_j (chunks lane, lane + 32, ...); summed over the warp and added to
// V * C it is the stream bit where the exception area starts (row_codec.h's exception_start()), a
// per-table constant each warp computes once.
template <int W>
IBP_HD uint32_t lane_free_bits_sum(const uint64_t* mask, int lane, int num_chunks) {
  uint32_t sum = 0;
  for (int j = lane; j < num_chunks; j += kWarpSize) {
    sum += static_cast<uint32_t>(W - popcount64(mask[j] & low_bits(W)));
  }
  return sum;
}

// Chunk value of a lane whose free field starts at stream bit `field` and (when it is escaped)
// whose exception bits start at `exception`; `shift` is the slot's byte offset in the
// staging buffer. The arithmetic is the CPU codec's decode_field() / patch_exception(), with the
// run-based deposit.
template <int W>
IBP_HD uint64_t lane_decode(const uint32_t* words, int shift, uint64_t field, uint64_t exception,
                            const LaneChunk& c) {
  const uint64_t base = 8 * static_cast<uint64_t>(shift);
  const uint64_t x = decode_field<PortableBitOps>(read_staged_bits<W>(words, base + field),
                                                  ~c.mask & low_bits(W), c.bitval);
  if (c.participates || !c.valid) return x;
  return patch_exception<PortableBitOps>(x, read_staged_bits<W>(words, base + exception), c.mask);
}

// Gather dedupe. After the sort, equal ids are adjacent; position i is a run head when its id
// differs from the previous one or i is a multiple of kRunCap (runs are cut so a hot id spreads
// over several warps). A head's warp writes the row to every position of its run: lane l tests
// position head + l, and the run is the prefix of lanes that pass. ids == nullptr is the
// identity (ids[i] = i, every position its own run).
inline constexpr int64_t kRunCap = kWarpSize;

IBP_HD bool is_run_head(const int64_t* ids, int64_t i) {
  return ids == nullptr || i % kRunCap == 0 || ids[i] != ids[i - 1];
}

IBP_HD bool lane_in_run(const int64_t* ids, int64_t n, int64_t head, int lane) {
  const int64_t p = head + lane;
  return lane == 0 || (ids != nullptr && p < n && p % kRunCap != 0 && ids[p] == ids[head]);
}

}  // namespace ibpembed::gpu
