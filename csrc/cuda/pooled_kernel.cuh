// SPDX-License-Identifier: Apache-2.0
//
// Pooled lookup (lookup.h) fused with decompression: warp per bag, the bag's ids in request
// order, accumulation in fp32 in shared memory owned lane by lane, so decoded rows never reach
// global memory. Compressed rows are decoded into a per-warp row buffer in shared memory, raw
// rows are accumulated straight from the staging buffer.
//
// NOTE(cuda): ids are deliberately not sorted here. The CPU path accumulates each bag in index
// order; doing the same, with every multiply and add rounded separately (__fmul_rn/__fadd_rn, no
// FMA contraction), makes SUM and MEAN equal to the CPU result bit for bit (NaN payloads aside).
// Sorting would reorder the sums. Repeated hot ids are left to the L2 cache.
#pragma once

#include "ibpembed/numeric.h"
#include "row_pipeline.cuh"

namespace ibpembed::gpu {

__host__ __device__ inline int64_t round16(int64_t bytes) {
  return (bytes + kVecBytes - 1) & ~int64_t{kVecBytes - 1};
}

// Decoded row: V whole chunks, plus read slack for the funnel reads of the accumulate loop.
__host__ __device__ inline int64_t rowbuf_bytes(const TableView& t) {
  return round16(static_cast<int64_t>(t.num_chunks) * (t.chunk_bits / 8)) + kVecBytes;
}

// Per warp: two staging buffers, the decoded row, the fp32 accumulators.
__host__ __device__ inline int64_t pooled_smem_per_warp(const TableView& t, int64_t stage_bytes,
                                                        int64_t dim) {
  return kStages * stage_bytes + rowbuf_bytes(t) + round16(4 * dim);
}

// Where a warp stands in its sequence of (bag, id) pairs: bags w, w + stride, ...; ids in order.
struct Cursor {
  int64_t bag;
  int64_t begin;  // offsets[bag]
  int64_t idx;    // position in ids
  int64_t end;    // offsets[bag + 1]
};

// Writes an empty bag's output row (zeros, for SUM and MEAN alike).
__device__ __forceinline__ void zero_bag(const PooledArgs& a, int64_t bag, int lane) {
  for (int64_t d = lane; d < a.dim; d += kWarpSize) a.out[bag * a.dim + d] = 0.0f;
}

// Advances to the next id; bags without ids (empty, or invalid and reported) are written as
// zeros on the way. Returns false past the warp's last bag.
__device__ __forceinline__ bool advance(const PooledArgs& a, Cursor& c, int64_t stride, int lane) {
  ++c.idx;
  while (c.idx >= c.end) {
    c.bag += stride;
    if (c.bag >= a.num_bags) return false;
    const int64_t begin = a.offsets[c.bag];
    const int64_t end = a.offsets[c.bag + 1];
    const bool bad = begin < 0 || end < begin || end > a.nnz || (c.bag == 0 && begin != 0) ||
                     (c.bag == a.num_bags - 1 && end != a.nnz);
    if (bad) report(a.error, kErrOffsets, lane);
    if (bad || begin == end) {
      zero_bag(a, c.bag, lane);
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
__device__ __forceinline__ void accumulate_row_bits(const PooledArgs& a, const uint32_t* words,
                                                    uint64_t bitbase, float weight, float* acc,
                                                    int lane) {
  switch (a.dtype) {
    case DType::kFloat32:
      for (int64_t d = lane; d < a.dim; d += kWarpSize) {
        const auto bits = static_cast<uint32_t>(read_staged_bits<32>(words, bitbase + 32 * d));
        acc[d] = accumulate(acc[d], weight, bits_to_float(bits));
      }
      break;
    case DType::kBFloat16:
      for (int64_t d = lane; d < a.dim; d += kWarpSize) {
        const auto h = static_cast<uint16_t>(read_staged_bits<16>(words, bitbase + 16 * d));
        acc[d] = accumulate(acc[d], weight, bf16_to_float(h));
      }
      break;
    case DType::kFloat16:
      for (int64_t d = lane; d < a.dim; d += kWarpSize) {
        const auto h = static_cast<uint16_t>(read_staged_bits<16>(words, bitbase + 16 * d));
        acc[d] = accumulate(acc[d], weight, fp16_to_float(h));
      }
      break;
    case DType::kInt8Rowwise: {
      const auto header = static_cast<uint32_t>(read_staged_bits<32>(words, bitbase));
      const float scale = fp16_to_float(static_cast<uint16_t>(header));
      const float bias = fp16_to_float(static_cast<uint16_t>(header >> 16));
      const uint64_t codes = bitbase + 8 * kInt8RowwiseHeaderBytes;
      for (int64_t d = lane; d < a.dim; d += kWarpSize) {
        const auto q = static_cast<uint8_t>(read_staged_bits<8>(words, codes + 8 * d));
        const float v = __fadd_rn(__fmul_rn(static_cast<float>(q), scale), bias);
        acc[d] = accumulate(acc[d], weight, v);
      }
      break;
    }
    default: break;  // rejected on the host: plain int8/uint8 rows cannot be pooled
  }
}

// out[bag] = acc (SUM) or acc / L (MEAN, as the CPU: one rounded reciprocal, then multiplies);
// resets the accumulators for the warp's next bag.
__device__ __forceinline__ void finish_bag(const PooledArgs& a, const Cursor& c, float* acc,
                                           int lane) {
  const bool mean = a.pooling == Pooling::kMean;
  const float inv = mean ? __fdiv_rn(1.0f, static_cast<float>(c.end - c.begin)) : 1.0f;
  for (int64_t d = lane; d < a.dim; d += kWarpSize) {
    a.out[c.bag * a.dim + d] = mean ? __fmul_rn(acc[d], inv) : acc[d];
    acc[d] = 0.0f;
  }
}

template <int W>
__global__ void __launch_bounds__(kMaxWarpsPerBlock* kWarpSize, kMinBlocksPerSm)
    pooled_kernel(PooledArgs a, Staging st) {
  static_assert(kStages == 2, "the loop alternates between two staging buffers with k & 1");
  IBP_DYNAMIC_SMEM(smem);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const TableView& t = a.table.view;
  const int64_t stage_bytes = st.buffer_bytes;
  uint8_t* mine = smem + warp * pooled_smem_per_warp(t, stage_bytes, a.dim);
  uint8_t* rowbuf = mine + kStages * stage_bytes;
  auto* acc = reinterpret_cast<float*>(rowbuf + rowbuf_bytes(t));
  if (blockIdx.x == 0 && warp == 0) check_table(a.table, lane, a.error);
  for (int64_t d = lane; d < a.dim; d += kWarpSize) acc[d] = 0.0f;

  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps;
  const uint64_t exceptions = exception_area_start<W>(t, lane);
  // Start one stride before the warp's first bag with an exhausted range: advance() opens it.
  Cursor cur{static_cast<int64_t>(blockIdx.x) * warps + warp - stride, 0, 0, 0};
  bool have = advance(a, cur, stride, lane);
  StagedRow s_cur{};
  if (have) s_cur = stage_row(a.table, a.ids[cur.idx], mine, st, lane, a.error);
  for (int k = 0; have; ++k) {
    // Issue the next id's copy (possibly in a later bag) before waiting for this one.
    Cursor nxt = cur;
    const bool have_nxt = advance(a, nxt, stride, lane);
    StagedRow s_nxt{};
    if (have_nxt) {
      s_nxt = stage_row(a.table, a.ids[nxt.idx], mine + ((k + 1) & 1) * stage_bytes, st, lane,
                        a.error);
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    __syncwarp();
    const uint8_t* stage = mine + (k & 1) * stage_bytes;
    const float weight = a.weights != nullptr ? a.weights[cur.idx] : 1.0f;
    if (s_cur.ok && s_cur.compressed) {
      // Lanes own chunks while decoding but elements while accumulating: go through rowbuf.
      auto to_rowbuf = [&](const LaneChunk& c, uint64_t x) {
        if (c.valid) store_chunk_to<W>(rowbuf, t.row_bytes, c.j, x, true);
      };
      decode_staged_row<W>(t, s_cur, stage, exceptions, lane, a.error, to_rowbuf);
      __syncwarp();
      accumulate_row_bits(a, reinterpret_cast<const uint32_t*>(rowbuf), 0, weight, acc, lane);
    } else if (s_cur.ok) {
      accumulate_row_bits(a, reinterpret_cast<const uint32_t*>(stage),
                          8 * static_cast<uint64_t>(s_cur.shift), weight, acc, lane);
    }
    if (cur.idx + 1 == cur.end) finish_bag(a, cur, acc, lane);
    // The staging buffer and rowbuf are reused next iteration.
    __syncwarp();
    cur = nxt;
    s_cur = s_nxt;
    have = have_nxt;
  }
}

}  // namespace ibpembed::gpu
