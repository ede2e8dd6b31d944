// SPDX-License-Identifier: Apache-2.0
//
// Pooled lookup (lookup.h) fused with decompression, for every table of a request in one launch
// (PooledArgs: parts of tables of one chunk width): warp per bag, the bag's ids in request order,
// accumulation in fp32 in shared memory owned lane by lane, so decoded rows never reach global
// memory. Compressed rows are decoded into a per-warp row buffer in shared memory, raw rows are
// accumulated straight from their staging buffer.
//
// Staging. The lanes of a warp resolve up to 32 of a bag's index entries at once (each lane one
// row's slot offset and size), then the warp keeps kPooledStages - 1 rows in flight ahead of the
// one it accumulates (a ring of staging buffers; the rows may lie in its next bags, of any part),
// issuing only copies: a bag's rows are staged before they are accumulated, so a bag of L rows
// costs about L / kPooledStages PCIe round trips instead of L. A row whose id repeats the
// previous row's (same table, stored compressed) is not staged again: it is accumulated from the
// row buffer, which still holds its decoded bits.
//
// NOTE(cuda): ids are deliberately not sorted here. The CPU path accumulates each bag in index
// order; doing the same, with every multiply and add rounded separately (__fmul_rn/__fadd_rn, no
// FMA contraction), makes SUM and MEAN equal to the CPU result bit for bit (NaN payloads aside).
// Sorting would reorder the sums; staging ahead and reusing a decoded row do not.
#pragma once

#include "ibpembed/numeric.h"
#include "row_pipeline.cuh"

namespace ibpembed::gpu {

// Rows in flight per warp: the one accumulated and kPooledStages - 1 staged ahead.
inline constexpr int kPooledStages = 4;

// What the warp knows about a row in one staging buffer, written when its copy is issued and
// read when it is accumulated (kept in shared memory, not registers: kPooledStages of them).
struct StageMeta {
  int64_t slot_bytes;
  int64_t idx;          // position in ids
  int64_t out_row;      // row of the part's output
  int64_t bag_len;      // ids in the row's bag
  uint64_t exceptions;  // exception_area_start() of the row's table
  int32_t part;
  int32_t shift;
  int32_t flags;  // kMeta* bits
};

enum StageFlags : int32_t {
  kMetaOk = 1,          // in range and consistent: the copy was made (or the row is reused)
  kMetaCompressed = 2,  // bitmask bit
  kMetaReuse = 4,       // the previous row's decoded bits, still in the row buffer
  kMetaLast = 8,        // the last id of its bag: the bag is written after it
};

// The rows of a bag the warp's lanes resolved together (in shared memory, not registers: the
// kernel is at its register budget): ids positions [begin, end) of part `part`, entry j for
// position begin + j.
struct ResolvedWindow {
  int64_t begin;
  int64_t end;
  int32_t part;
  int32_t unused;
  int64_t ids[kWarpSize];
  ResolvedRow rows[kWarpSize];
};

// Per warp: the stage metadata, the resolved window, the staging ring, the decoded row, the fp32
// accumulators.
__host__ __device__ inline int64_t pooled_meta_bytes() {
  return round16(static_cast<int64_t>(sizeof(StageMeta)) * kPooledStages) +
         round16(static_cast<int64_t>(sizeof(ResolvedWindow)));
}

__host__ __device__ inline int64_t pooled_smem_per_warp(const PooledShape& s) {
  return pooled_meta_bytes() + kPooledStages * s.stage_bytes + s.rowbuf_bytes + round16(4 * s.dim);
}

__device__ __forceinline__ const PooledTable& part_table(const PooledArgs& a, int part) {
  return a.tables == nullptr ? a.single : a.tables[a.part_table[part]];
}

// The HBM tier of a part's table, or nullptr.
__device__ __forceinline__ const DeviceTier* part_tier(const PooledArgs& a, int part) {
  return a.tables == nullptr || a.tiers == nullptr ? nullptr : &a.tiers[a.part_table[part]];
}

// Where a warp stands in its sequence of (bag, id) pairs: launch bags g, g + stride, ...; ids in
// order.
struct Cursor {
  int64_t g;      // the bag's number in the launch
  int64_t begin;  // offsets[bag]
  int64_t idx;    // position in ids
  int64_t end;    // offsets[bag + 1]
  int part;
};

// Advances to the next id; bags without ids (empty, or invalid and reported) are written as
// zeros on the way. Returns false past the warp's last bag.
__device__ __forceinline__ bool advance(const PooledArgs& a, Cursor& c, int64_t stride, int lane) {
  ++c.idx;
  const int64_t total = a.bag_start[a.num_parts];
  while (c.idx >= c.end) {
    c.g += stride;
    if (c.g >= total) return false;
    while (c.g >= a.bag_start[c.part + 1]) ++c.part;  // g only grows: the part too
    const int64_t bag = a.first_bag[c.part] + (c.g - a.bag_start[c.part]);
    const int64_t begin = a.offsets[bag];
    const int64_t end = a.offsets[bag + 1];
    const bool bad = begin < 0 || end < begin || end > a.nnz || (bag == 0 && begin != 0) ||
                     (bag == a.num_offset_bags - 1 && end != a.nnz);
    if (bad) report(a.error, kErrOffsets, lane);
    if (bad || begin == end) {
      const int64_t dim = part_table(a, c.part).dim;
      float* out = a.out[c.part] + (c.g - a.bag_start[c.part]) * dim;
      for (int64_t d = lane; d < dim; d += kWarpSize) out[d] = 0.0f;
      continue;
    }
    c.begin = c.idx = begin;
    c.end = end;
  }
  return true;
}

__device__ __forceinline__ float accumulate(float acc, float weight, float v) {
  return __fadd_rn(acc, __fmul_rn(weight, v));
}

// acc[d] += weight * value(d) for this lane's d, reading the row's bytes from `words` starting at
// bit `bitbase` (a decoded row at 0, or a raw slot at 8 * shift in its staging buffer). Values
// widen exactly as on the CPU (numeric.h), in the same order of roundings.
__device__ __forceinline__ void accumulate_row_bits(DType dtype, int64_t dim, const uint32_t* words,
                                                    uint64_t bitbase, float weight, float* acc,
                                                    int lane) {
  switch (dtype) {
    case DType::kFloat32:
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const auto bits = static_cast<uint32_t>(read_staged_bits<32>(words, bitbase + 32 * d));
        acc[d] = accumulate(acc[d], weight, bits_to_float(bits));
      }
      break;
    case DType::kBFloat16:
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const auto h = static_cast<uint16_t>(read_staged_bits<16>(words, bitbase + 16 * d));
        acc[d] = accumulate(acc[d], weight, bf16_to_float(h));
      }
      break;
    case DType::kFloat16:
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const auto h = static_cast<uint16_t>(read_staged_bits<16>(words, bitbase + 16 * d));
        acc[d] = accumulate(acc[d], weight, fp16_to_float(h));
      }
      break;
    case DType::kInt8Rowwise: {
      const auto header = static_cast<uint32_t>(read_staged_bits<32>(words, bitbase));
      const float scale = fp16_to_float(static_cast<uint16_t>(header));
      const float bias = fp16_to_float(static_cast<uint16_t>(header >> 16));
      const uint64_t codes = bitbase + 8 * kInt8RowwiseHeaderBytes;
      for (int64_t d = lane; d < dim; d += kWarpSize) {
        const auto q = static_cast<uint8_t>(read_staged_bits<8>(words, codes + 8 * d));
        const float v = __fadd_rn(__fmul_rn(static_cast<float>(q), scale), bias);
        acc[d] = accumulate(acc[d], weight, v);
      }
      break;
    }
    default: break;  // rejected on the host: plain int8/uint8 rows cannot be pooled
  }
}

// out = acc (SUM) or acc / L (MEAN, as the CPU: one rounded reciprocal, then multiplies);
// resets the accumulators for the warp's next bag.
__device__ __forceinline__ void finish_bag(const PooledArgs& a, float* out, int64_t dim,
                                           int64_t bag_len, float* acc, int lane) {
  const bool mean = a.pooling == Pooling::kMean;
  const float inv = mean ? __fdiv_rn(1.0f, static_cast<float>(bag_len)) : 1.0f;
  for (int64_t d = lane; d < dim; d += kWarpSize) {
    out[d] = mean ? __fmul_rn(acc[d], inv) : acc[d];
    acc[d] = 0.0f;
  }
}

template <int W>
__global__ void __launch_bounds__(kMaxWarpsPerBlock* kWarpSize, kMinBlocksPerSm)
    pooled_kernel(PooledArgs a, Staging st, PooledShape shape) {
  IBP_DYNAMIC_SMEM(smem);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const int64_t stage_bytes = st.buffer_bytes;
  uint8_t* mine = smem + warp * pooled_smem_per_warp(shape);
  auto* meta = reinterpret_cast<StageMeta*>(mine);
  auto* window = reinterpret_cast<ResolvedWindow*>(
      mine + round16(static_cast<int64_t>(sizeof(StageMeta)) * kPooledStages));
  if (lane == 0) {
    window->begin = window->end = 0;
    window->part = -1;
  }
  __syncwarp();
  uint8_t* stages = mine + pooled_meta_bytes();
  uint8_t* rowbuf = stages + kPooledStages * stage_bytes;
  auto* acc = reinterpret_cast<float*>(rowbuf + shape.rowbuf_bytes);
  if (blockIdx.x == 0 && warp == 0) {
    for (int p = 0; p < a.num_parts; ++p) check_table(part_table(a, p).table, lane, a.error);
  }
  for (int64_t d = lane; d < shape.dim; d += kWarpSize) acc[d] = 0.0f;

  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps;
  // Start one stride before the warp's first bag with an exhausted range: advance() opens it.
  Cursor nxt{static_cast<int64_t>(blockIdx.x) * warps + warp - stride, 0, 0, 0, 0};
  bool have = advance(a, nxt, stride, lane);
  // The table whose exception_area_start() is cached, and the last row staged.
  int cached_part = -1;
  uint64_t exceptions = 0;
  int64_t prev_id = -1;
  int prev_part = -1;
  bool prev_decoded = false;  // the last row staged was compressed and consistent
  int pending = 0;            // rows issued and not yet accumulated

  // Issues the copy of the cursor's row into staging buffer `k % kPooledStages` (and its
  // metadata), or an empty group past the warp's last row, so every thread commits one group
  // per call and the wait below always retires the oldest row.
  auto issue = [&](int k) {
    if (!have) {
      cp_async_commit();
      return;
    }
    const PooledTable& pt = part_table(a, nxt.part);
    const TableView& t = pt.table.view;
    if (nxt.part != cached_part) {
      exceptions = exception_area_start<W>(t, lane);
      cached_part = nxt.part;
    }
    // The lanes resolve the cursor's next (up to) 32 rows of its bag together, one each: a
    // bag's index entries cost one round of loads, and each issue() is left with its copies
    // only, instead of a dependent index load before every row's copy.
    if (nxt.part != window->part || nxt.idx < window->begin || nxt.idx >= window->end) {
      const int64_t begin = nxt.idx;
      const int64_t end = std::min<int64_t>(nxt.end, nxt.idx + kWarpSize);
      const DeviceTier* tier = part_tier(a, nxt.part);
      __syncwarp();  // every lane is done reading the previous window
      int32_t source = kRowOutOfRange;
      if (begin + lane < end) {
        const int64_t id = a.ids[begin + lane];
        window->ids[lane] = id;
        window->rows[lane] = resolve_row(t, tier, id);
        source = window->rows[lane].source;
      }
      if (tier != nullptr && tier->dir != nullptr) {
        const unsigned hits = __popc(__ballot_sync(kFullWarp, source == kRowInTier));
        const unsigned misses = __popc(__ballot_sync(kFullWarp, source == kRowInTable));
        count_tier_reads(tier, hits, misses, lane);
      }
      if (lane == 0) {
        window->begin = begin;
        window->end = end;
        window->part = nxt.part;
      }
      __syncwarp();
    }
    const int src = static_cast<int>(nxt.idx - window->begin);
    const int64_t id = window->ids[src];
    const ResolvedRow row = window->rows[src];
    const bool reuse = prev_decoded && id == prev_id && nxt.part == prev_part;
    StagedRow s{0, 0, true, true};
    if (reuse) {
      cp_async_commit();
    } else {
      s = stage_resolved(pt.table, part_tier(a, nxt.part), row,
                         stages + (k % kPooledStages) * stage_bytes, st, lane, a.error);
    }
    prev_id = id;
    prev_part = nxt.part;
    prev_decoded = s.ok && s.compressed;
    if (lane == 0) {
      StageMeta& m = meta[k % kPooledStages];
      m.slot_bytes = s.slot_bytes;
      m.idx = nxt.idx;
      m.out_row = nxt.g - a.bag_start[nxt.part];
      m.bag_len = nxt.end - nxt.begin;
      m.exceptions = exceptions;
      m.part = nxt.part;
      m.shift = s.shift;
      m.flags = (s.ok ? kMetaOk : 0) | (s.compressed ? kMetaCompressed : 0) |
                (reuse ? kMetaReuse : 0) | (nxt.idx + 1 == nxt.end ? kMetaLast : 0);
    }
    ++pending;
    have = advance(a, nxt, stride, lane);
  };

  for (int k = 0; k < kPooledStages - 1; ++k) issue(k);
  for (int k = 0; pending > 0; ++k) {
    // Refill the buffer accumulated last iteration, then wait for the oldest row only.
    issue(k + kPooledStages - 1);
    cp_async_wait<kPooledStages - 1>();
    __syncwarp();
    const StageMeta m = meta[k % kPooledStages];
    const PooledTable& pt = part_table(a, m.part);
    const TableView& t = pt.table.view;
    const uint8_t* stage = stages + (k % kPooledStages) * stage_bytes;
    const float weight = a.weights != nullptr ? a.weights[m.idx] : 1.0f;
    const bool ok = (m.flags & kMetaOk) != 0;
    if (ok && (m.flags & kMetaCompressed) != 0) {
      if ((m.flags & kMetaReuse) == 0) {
        // Lanes own chunks while decoding but elements while accumulating: go through rowbuf.
        auto to_rowbuf = [&](const LaneChunk& c, uint64_t x) {
          if (c.valid) store_chunk_to<W>(rowbuf, t.row_bytes, c.j, x, true);
        };
        const StagedRow s{m.slot_bytes, m.shift, true, true};
        decode_staged_row<W>(t, s, stage, m.exceptions, lane, a.error, to_rowbuf);
        __syncwarp();
      }
      accumulate_row_bits(pt.dtype, pt.dim, reinterpret_cast<const uint32_t*>(rowbuf), 0, weight,
                          acc, lane);
    } else if (ok) {
      accumulate_row_bits(pt.dtype, pt.dim, reinterpret_cast<const uint32_t*>(stage),
                          8 * static_cast<uint64_t>(m.shift), weight, acc, lane);
    }
    if ((m.flags & kMetaLast) != 0) {
      finish_bag(a, a.out[m.part] + m.out_row * pt.dim, pt.dim, m.bag_len, acc, lane);
    }
    --pending;
    // The staging buffer, its metadata and rowbuf are reused from the next iteration on.
    __syncwarp();
  }
}

}  // namespace ibpembed::gpu
