// SPDX-License-Identifier: Apache-2.0
//
// The warp-level machinery both kernel families share: locate a row's slot, stage it from the
// payload into shared memory with 16-byte cp.async copies, decode it chunk-parallel. One warp owns
// one row at a time and keeps the next row's copy in flight while it decodes the current one
// (two staging buffers per warp), so PCIe latency overlaps decode even for a warp working through
// a long bag on its own. Device code only: host-side launch planning is in launch_plan.cuh.
//
// NOTE(cuda): this file and the kernel headers (gather_kernel.cuh, pooled_kernel.cuh) also compile
// as plain C++ for the host SIMT emulator of tools/simt (IBPEMBED_SIMT defined): each thread
// of a block runs as a host thread, and the emulator supplies the warp collectives, cp.async and
// shared memory: the guarded block below (cp.async and the shared-memory declaration) is the only
// code that differs.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ibpembed/tier.h"
#include "kernels.h"
#include "warp_decode.cuh"

namespace ibpembed::gpu {

inline constexpr unsigned kFullWarp = 0xffffffffu;
// 8 warps per block when shared memory allows: enough warps per SM to keep many PCIe reads in
// flight without making a block's shared memory too coarse to pack (halved for very wide rows).
inline constexpr int kMaxWarpsPerBlock = 8;
inline constexpr int kStages = 2;
// Register budget: 3 resident 8-warp blocks per SM (<= 85 registers a thread). Without it ptxas
// picks 64 registers for some instantiations and spills; with a budget of 1 block it takes ~124
// and caps residency at 16 warps, too few reads in flight to cover PCIe latency.
inline constexpr int kMinBlocksPerSm = 3;

__device__ __forceinline__ void report(int32_t* error, int32_t bits, int lane) {
  if (lane == 0) atomicOr(error, bits);
}

#if !defined(IBPEMBED_SIMT)  // the emulator defines these three and the shared-memory macro
// cp.async.cg: 16 bytes global -> shared, bypassing L1 (each payload byte is read once).
// Works on the device alias of pinned host memory as on device memory: both are global space.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The block's dynamic shared memory, as a byte array named `name`.
#define IBP_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#endif

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < kWarpSize; d <<= 1) {
    const int y = __shfl_up_sync(kFullWarp, v, d);
    if (lane >= d) v += y;
  }
  return v;
}

// How a launch stages rows: the size of each staging buffer and how the copies are made.
struct Staging {
  int64_t buffer_bytes;  // stage_buffer_bytes() of the table
  bool async;            // cp.async (default), or plain 16-byte loads and stores
};

// A row whose slot copy has been issued into a staging buffer.
struct StagedRow {
  int64_t slot_bytes;
  int shift;        // slot start inside the buffer
  bool compressed;  // bitmask bit
  bool ok;          // in range and consistent: only then was anything copied
};

// Where a slot's bytes live: the table's payload (host memory, zero-copy) or its HBM tier's.
struct SlotSource {
  const uint8_t* payload;
  int64_t payload_bytes;
};

__device__ __forceinline__ SlotSource table_source(const DeviceTable& dt) {
  return SlotSource{dt.view.payload, dt.payload_bytes};
}

__device__ __forceinline__ SlotSource tier_source(const DeviceTier& tier) {
  return SlotSource{tier.payload, tier.payload_bytes};
}

// Issues the copies of the slot at `offset` of `src` (`slot_bytes`, warp-uniform) into `stage`
// and commits one cp.async group (also when nothing is copied, so every thread's group count
// stays in step).
__device__ __forceinline__ StagedRow stage_slot(const SlotSource& src, int64_t row_bytes,
                                                int64_t offset, int64_t slot_bytes, bool compressed,
                                                uint8_t* stage, const Staging& st, int lane,
                                                int32_t* error) {
  StagedRow s{slot_bytes, 0, compressed, false};
  const Window w = stage_window(offset, s.slot_bytes);
  s.shift = w.shift;
  // A raw slot must hold the row; any slot must fit the buffer and the payload. Checked before
  // the copy so a corrupt index cannot make the warp read out of bounds; the payload bound as
  // `first <= bytes - window`, since a corrupt block base near 2^63 would wrap `first + window`
  // back into range.
  s.ok = offset >= 0 && w.first <= src.payload_bytes - int64_t{kVecBytes} * w.vecs &&
         int64_t{kVecBytes} * w.vecs + 2 * kVecBytes <= st.buffer_bytes &&
         (s.compressed || s.slot_bytes >= row_bytes);
  if (s.ok) {
    for (int v = lane; v < w.vecs; v += kWarpSize) {
      uint8_t* dst = stage + kVecBytes * v;
      const uint8_t* from = src.payload + w.first + int64_t{kVecBytes} * v;
      if (st.async) {
        cp_async16(dst, from);
      } else {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(from);
      }
    }
  } else {
    report(error, kErrTable, lane);
  }
  cp_async_commit();
  return s;
}

// Adds a warp's tier hits and misses to the device counters (lane 0, one atomic each).
__device__ __forceinline__ void count_tier_reads(const DeviceTier* tier, unsigned hits,
                                                 unsigned misses, int lane) {
  if (lane != 0 || tier == nullptr || tier->counters == nullptr) return;
  if (hits != 0) atomicAdd(tier->counters + kTierHits, static_cast<unsigned long long>(hits));
  if (misses != 0) {
    atomicAdd(tier->counters + kTierMisses, static_cast<unsigned long long>(misses));
  }
}

// Where row r (in range) is in `tier` (may be null): not held, or its slot in the tier's payload,
// found as resolve_row() finds a slot of the table.
struct TierSlot {
  int64_t offset;
  int64_t slot_bytes;
  bool held;        // the residency map holds the row
  bool compressed;  // the slot holds the row as the table stores it, compressed
  bool ok;          // a slot of the tier: a corrupt directory is reported, never read through
};

__device__ __forceinline__ TierSlot find_tier_slot(const TableView& t, const DeviceTier* tier,
                                                   int64_t r) {
  TierSlot x{0, 0, false, false, true};
  if (tier == nullptr || tier->dir == nullptr) return x;
  const RankSlot s = rank_slot(tier->dir, r);
  if (!s.held) return x;
  x.held = true;
  const auto slots = static_cast<uint64_t>(tier->num_slots);
  if (s.base >= slots || s.slot >= slots) {
    x.ok = false;
    return x;
  }
  const auto slot = static_cast<int64_t>(s.slot);
  if (tier->slot_offset == nullptr) {  // decoded form: a fixed stride
    x.slot_bytes = round16(t.row_bytes);
    x.offset = slot * x.slot_bytes;
    return x;
  }
  x.offset = tier->slot_offset[slot];
  x.slot_bytes = tier->slot_offset[slot + 1] - x.offset;
  x.compressed = row_is_compressed(t, r);
  x.ok = x.slot_bytes >= 0;
  return x;
}

// Warp-uniform r. Finds row r's slot, in `tier` (may be null) when it holds the row, else in the
// table (the warp's lanes load its block's sizes together), issues its window's copies into
// `stage` and commits one cp.async group.
__device__ __forceinline__ StagedRow stage_row(const DeviceTable& dt, const DeviceTier* tier,
                                               int64_t r, uint8_t* stage, const Staging& st,
                                               int lane, int32_t* error) {
  const TableView& t = dt.view;
  if (r < 0 || r >= t.num_rows) {
    report(error, kErrIndex, lane);
    cp_async_commit();
    return StagedRow{0, 0, false, false};
  }
  const TierSlot x = find_tier_slot(t, tier, r);
  count_tier_reads(tier, x.held, !x.held, lane);
  if (x.held) {
    if (!x.ok) {
      report(error, kErrTable, lane);
      cp_async_commit();
      return StagedRow{0, 0, false, false};
    }
    return stage_slot(tier_source(*tier), t.row_bytes, x.offset, x.slot_bytes, x.compressed, stage,
                      st, lane, error);
  }
  // row_units is padded to whole blocks of 32, so every lane may load its byte.
  const int64_t b = r >> 5;
  const int in_block = static_cast<int>(r & 31);
  const uint32_t u = t.row_units[b * kRowsPerBlock + lane];
  const uint32_t before = __reduce_add_sync(kFullWarp, units_before_term(u, lane, in_block));
  const uint32_t units = __shfl_sync(kFullWarp, u, in_block);
  const int64_t offset = t.block_base[b] + t.unit_bytes * before;
  return stage_slot(table_source(dt), t.row_bytes, offset, t.unit_bytes * units,
                    row_is_compressed(t, r), stage, st, lane, error);
}

// A row's slot found by one lane on its own (each lane its own row, no collective): what
// stage_row() finds warp-wide, so that a warp resolves up to 32 rows with one round of loads.
enum RowSource : int32_t {
  kRowOutOfRange = 0,
  kRowInTable = 1,  // offset is in the table's payload
  kRowInTier = 2,   // offset is in the tier's payload
  kRowBadSlot = 3,  // the residency map names a slot the tier does not have
};

struct ResolvedRow {
  int64_t offset;
  int64_t slot_bytes;
  int32_t compressed;
  int32_t source;  // RowSource
};

__device__ __forceinline__ ResolvedRow resolve_row(const TableView& t, const DeviceTier* tier,
                                                   int64_t r) {
  if (r < 0 || r >= t.num_rows) return ResolvedRow{0, 0, 0, kRowOutOfRange};
  const TierSlot x = find_tier_slot(t, tier, r);
  if (x.held) {
    return ResolvedRow{x.offset, x.slot_bytes, x.compressed, x.ok ? kRowInTier : kRowBadSlot};
  }
  const int64_t b = r >> 5;
  const int in_block = static_cast<int>(r & 31);
  const uint8_t* units = t.row_units + b * kRowsPerBlock;
  uint32_t before = 0;
  for (int j = 0; j < in_block; ++j) before += units[j];
  return ResolvedRow{t.block_base[b] + t.unit_bytes * before, t.unit_bytes * units[in_block],
                     row_is_compressed(t, r), kRowInTable};
}

// stage_row() for a row a lane resolved: only the copies are left to issue.
__device__ __forceinline__ StagedRow stage_resolved(const DeviceTable& dt, const DeviceTier* tier,
                                                    const ResolvedRow& x, uint8_t* stage,
                                                    const Staging& st, int lane, int32_t* error) {
  if (x.source == kRowOutOfRange || x.source == kRowBadSlot) {
    report(error, x.source == kRowOutOfRange ? kErrIndex : kErrTable, lane);
    cp_async_commit();
    return StagedRow{0, 0, false, false};
  }
  const SlotSource src = x.source == kRowInTier ? tier_source(*tier) : table_source(dt);
  return stage_slot(src, dt.view.row_bytes, x.offset, x.slot_bytes, x.compressed != 0, stage, st,
                    lane, error);
}

// Stream bit where the exception area of every compressed row of the table starts (format.h's
// E = V * C + sum_j k_j). A per-table constant: each warp computes it once, before its first row.
template <int W>
__device__ __forceinline__ uint64_t exception_area_start(const TableView& t, int lane) {
  const uint32_t lane_sum = lane_free_bits_sum<W>(t.mask, lane, t.num_chunks);
  const uint32_t sum = __reduce_add_sync(kFullWarp, lane_sum);
  return free_fields_start(t.num_chunks, t.code_bits) + sum;
}

// Decodes a compressed staged row chunk-parallel; every lane calls sink(c, x) for every group
// (also lanes whose chunk is past the end: c.valid is false), so sinks may use warp collectives.
// exception_start is exception_area_start() of the table.
template <int W, class Sink>
__device__ __forceinline__ void decode_staged_row(const TableView& t, const StagedRow& s,
                                                  const uint8_t* stage, uint64_t exception_start,
                                                  int lane, int32_t* error, Sink&& sink) {
  const auto* words = reinterpret_cast<const uint32_t*>(stage);
  const uint64_t slot_bits = 8 * static_cast<uint64_t>(s.slot_bytes);
  uint64_t fbase = free_fields_start(t.num_chunks, t.code_bits);
  uint64_t ebase = exception_start;
  // A slot too short for the codes is corrupt too. The code reads stay inside the staging buffer
  // all the same: V * C bits are at most a quarter of a row, and the buffer holds a raw slot.
  bool overrun = fbase > slot_bits;
  for (int g = 0; 32 * g < t.num_chunks; ++g) {
    const LaneChunk c =
        lane_chunk<W>(words, s.shift, t.mask, t.bitval, t.code_bits, g, lane, t.num_chunks);
    const int incl = warp_inclusive_scan(pack_lengths(c), lane);
    uint64_t field = fbase + static_cast<uint64_t>(packed_free(incl) - c.free);
    uint64_t exception = ebase + static_cast<uint64_t>(packed_exception(incl) - c.exception);
    // A consistent table never needs bits past its slot; a corrupt one reads (in bounds) from
    // the slot start instead and is reported.
    if (field + c.free > slot_bits || exception + c.exception > slot_bits) {
      overrun = true;
      field = exception = 0;
    }
    sink(c, lane_decode<W>(words, s.shift, field, exception, c));
    const int total = __shfl_sync(kFullWarp, incl, kWarpSize - 1);
    fbase += static_cast<uint64_t>(packed_free(total));
    ebase += static_cast<uint64_t>(packed_exception(total));
  }
  if (__any_sync(kFullWarp, overrun)) report(error, kErrTable, lane);
}

// Block 0, warp 0: the per-table checks the CPU op does before decoding (masks inside the chunk
// width, every codebook entry inside its position's mask, index bounds against the payload).
// Wrong masks or codebooks cannot make a read go out of bounds, so the other warps do not wait
// for this.
__device__ __forceinline__ void check_table(const DeviceTable& dt, int lane, int32_t* error) {
  const TableView& t = dt.view;
  const uint64_t outside = ~low_bits(t.chunk_bits);
  const int k = codebook_size(t.code_bits);
  bool bad = false;
  for (int j = lane; j < t.num_chunks; j += kWarpSize) {
    const uint64_t m = t.mask[j];
    bad |= (m & outside) != 0;
    for (int i = 0; i < k; ++i) bad |= (t.bitval[static_cast<int64_t>(j) * k + i] & ~m) != 0;
  }
  if (lane == 0) {
    const int64_t end = t.block_base[num_blocks(t.num_rows)];
    bad |= t.block_base[0] != 0 || end < 0 || end > dt.payload_bytes - kPayloadPad;
  }
  if (__any_sync(kFullWarp, bad)) report(error, kErrTable, lane);
}

// Stores one decoded chunk into a row at `dst`: a single aligned store when every chunk of the
// row is aligned (row_bytes a multiple of S, output base aligned), else byte stores of the bytes
// that lie inside the row.
template <int W>
__device__ __forceinline__ void store_chunk_to(uint8_t* dst, int64_t row_bytes, int j, uint64_t x,
                                               bool aligned) {
  constexpr int S = W / 8;
  uint8_t* p = dst + static_cast<int64_t>(j) * S;
  if (aligned) {
    if constexpr (W == 16) *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(x);
    if constexpr (W == 32) *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(x);
    if constexpr (W == 64) *reinterpret_cast<uint64_t*>(p) = x;
    return;
  }
  const int64_t n = std::min<int64_t>(S, row_bytes - static_cast<int64_t>(j) * S);
  for (int k = 0; k < n; ++k) p[k] = static_cast<uint8_t>(x >> (8 * k));
}

}  // namespace ibpembed::gpu
