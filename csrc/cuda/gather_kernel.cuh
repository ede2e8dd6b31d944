// SPDX-License-Identifier: Apache-2.0
//
// Zero-copy gather with in-kernel decompression: out[perm[i]] = row(ids[i]) for ids sorted on the
// GPU. Warp per row, lane per chunk (row_pipeline.cuh); rows with a clear bitmask bit are copied
// verbatim without touching the masks.
//
// Work split: global warp w takes sorted positions w, w + stride, ... Consecutive warps therefore
// fetch neighbouring rows at the same time, which is what sorting is for. Duplicates are adjacent
// after the sort: the first position of a run of equal ids (a "head") decodes the row once and
// writes it to every position of the run; runs are cut every kRunCap positions so a very hot id
// (Zipf) is spread over several warps instead of serialising on one.
#pragma once

#include "row_pipeline.cuh"

namespace ibpembed::gpu {

static_assert(kRunCap <= kWarpSize, "a run's destinations are held one per lane");
static_assert(kStages == 2, "the loop alternates between two staging buffers with k & 1");

// Shared memory per warp: two staging buffers and the destination rows of the current run.
__host__ __device__ inline int64_t gather_smem_per_warp(int64_t stage_bytes) {
  return kStages * stage_bytes + kRunCap * static_cast<int64_t>(sizeof(int64_t));
}

__device__ __forceinline__ int64_t row_at(const GatherArgs& a, int64_t i) {
  return a.ids == nullptr ? i : a.ids[i];
}

// First head at or after i among this warp's positions (i, i + stride, ...), or n.
__device__ __forceinline__ int64_t next_head(const GatherArgs& a, int64_t i, int64_t stride) {
  while (i < a.n && !is_run_head(a.ids, i)) i += stride;
  return i < a.n ? i : a.n;
}

// Writes the run starting at head i into dst_rows[0 .. len) (output row of each position) and
// returns len.
__device__ __forceinline__ int load_run(const GatherArgs& a, int64_t i, int lane,
                                        int64_t* dst_rows) {
  const unsigned run = __ballot_sync(kFullWarp, lane_in_run(a.ids, a.n, i, lane));
  const int len = run == kFullWarp ? kWarpSize : __ffs(~run) - 1;
  const int64_t p = i + lane;
  if (lane < len) dst_rows[lane] = a.perm == nullptr ? p : a.perm[p];
  __syncwarp();
  return len;
}

// Verbatim copy of a raw row from the staging buffer to one output row: 16-byte vectors when
// source, destination and width all allow, else 32-bit words realigned through the funnel read.
__device__ __forceinline__ void copy_raw_row(const uint8_t* stage, int shift, int64_t row_bytes,
                                             uint8_t* dst, int lane) {
  const auto dst_bits = reinterpret_cast<uintptr_t>(dst);
  const bool vec_ok = ((shift | row_bytes | dst_bits) & (kVecBytes - 1)) == 0;
  if (vec_ok) {  // shift is then 0: the slot starts the window
    const auto* src = reinterpret_cast<const uint4*>(stage);
    auto* out = reinterpret_cast<uint4*>(dst);
    for (int64_t v = lane; v < row_bytes / kVecBytes; v += kWarpSize) out[v] = src[v];
    return;
  }
  const auto* words = reinterpret_cast<const uint32_t*>(stage);
  const bool word_ok = ((row_bytes | dst_bits) & 3) == 0;
  for (int64_t k = lane; 4 * k < row_bytes; k += kWarpSize) {
    const auto v = static_cast<uint32_t>(read_staged_bits<32>(words, 8 * (shift + 4 * k)));
    if (word_ok) {
      reinterpret_cast<uint32_t*>(dst)[k] = v;
    } else {
      const int64_t n = std::min<int64_t>(4, row_bytes - 4 * k);
      for (int b = 0; b < n; ++b) dst[4 * k + b] = static_cast<uint8_t>(v >> (8 * b));
    }
  }
}

// Decode = false is the copy-without-decode mode (IBPEMBED_CUDA_DECODE=copy): every slot crosses
// PCIe as in the real gather, but a compressed slot's bytes are copied verbatim into the front of
// its output row instead of being decoded. Its rows are not the table's; its time is the paper's
// "ideal transfer", which the decode's cost is measured against.
template <int W, bool Decode = true>
__global__ void __launch_bounds__(kMaxWarpsPerBlock* kWarpSize, kMinBlocksPerSm)
    gather_kernel(GatherArgs a, Staging st) {
  IBP_DYNAMIC_SMEM(smem);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const int64_t stage_bytes = st.buffer_bytes;
  uint8_t* mine = smem + warp * gather_smem_per_warp(stage_bytes);
  auto* dst_rows = reinterpret_cast<int64_t*>(mine + kStages * stage_bytes);

  const TableView& t = a.table.view;
  if (blockIdx.x == 0 && warp == 0) check_table(a.table, lane, a.error);
  const bool aligned = t.row_bytes % (W / 8) == 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps;
  const uint64_t exceptions = exception_area_start<W>(t, lane);

  int64_t cur = next_head(a, static_cast<int64_t>(blockIdx.x) * warps + warp, stride);
  StagedRow s_cur{};
  if (cur < a.n) s_cur = stage_row(a.table, row_at(a, cur), mine, st, lane, a.error);
  for (int k = 0; cur < a.n; ++k) {
    // Issue the next row before waiting for this one: two rows in flight per warp.
    const int64_t nxt = next_head(a, cur + stride, stride);
    StagedRow s_nxt{};
    if (nxt < a.n) {
      s_nxt = stage_row(a.table, row_at(a, nxt), mine + ((k + 1) & 1) * stage_bytes, st, lane,
                        a.error);
    } else {
      cp_async_commit();
    }
    const int run = load_run(a, cur, lane, dst_rows);
    cp_async_wait<1>();
    __syncwarp();
    const uint8_t* stage = mine + (k & 1) * stage_bytes;
    if (!Decode && s_cur.ok && s_cur.compressed) {
      const int64_t bytes = std::min<int64_t>(s_cur.slot_bytes, t.row_bytes);
      for (int d = 0; d < run; ++d) {
        copy_raw_row(stage, s_cur.shift, bytes, a.out + dst_rows[d] * t.row_bytes, lane);
      }
    } else if (s_cur.ok && s_cur.compressed) {
      auto write = [&](const LaneChunk& c, uint64_t x) {
        if (!c.valid) return;
        for (int d = 0; d < run; ++d) {
          store_chunk_to<W>(a.out + dst_rows[d] * t.row_bytes, t.row_bytes, c.j, x, aligned);
        }
      };
      decode_staged_row<W>(t, s_cur, stage, exceptions, lane, a.error, write);
    } else if (s_cur.ok) {
      for (int d = 0; d < run; ++d) {
        copy_raw_row(stage, s_cur.shift, t.row_bytes, a.out + dst_rows[d] * t.row_bytes, lane);
      }
    }
    // The buffer and dst_rows are reused next iteration.
    __syncwarp();
    cur = nxt;
    s_cur = s_nxt;
  }
}

}  // namespace ibpembed::gpu
