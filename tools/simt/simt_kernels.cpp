// SPDX-License-Identifier: Apache-2.0
//
// The CUDA gather and pooled kernels (csrc/cuda/*_kernel.cuh, the very device code nvcc builds)
// run by the host SIMT emulator (simt.h, force-included), behind a C interface that
// tests/cuda/test_simt_kernels.py calls through ctypes with CPU tensors. The caller does what the
// CUDA op bindings do before a launch (sort the gather's ids; validate shapes), and picks the grid
// so that tests reach grid strides, several warps per block and several blocks.
//
// Each entry point returns the kernel's error word (ErrorBits, >= 0), or -1 when the emulator
// stopped the launch (divergent collectives, a deadlock, a cp.async out of bounds), with the
// reason in `message`.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../../../csrc/cuda/gather_kernel.cuh"
#include "../../../csrc/cuda/launch_shape.h"
#include "../../../csrc/cuda/pooled_kernel.cuh"

namespace {

using namespace ibpembed;
using namespace ibpembed::gpu;

DeviceTable table_of(const uint8_t* payload, int64_t payload_bytes, const int64_t* block_base,
                     const uint8_t* row_units, const int32_t* bitmask, const uint64_t* mask,
                     const uint64_t* bitval, int64_t bitval_len, int64_t num_rows,
                     int64_t row_bytes, int64_t unit_bytes, int chunk_bits) {
  const int v = chunks_per_row(row_bytes, chunk_bits);
  return DeviceTable{TableView{payload, block_base, row_units, bitmask, mask, bitval, num_rows,
                               row_bytes, unit_bytes, chunk_bits, v, code_bits_for(bitval_len, v)},
                     payload_bytes};
}

// The tier `tier` points at, or none (a null rank directory).
DeviceTier tier_or_none(const DeviceTier* tier) {
  return tier != nullptr ? *tier : DeviceTier{nullptr, nullptr, nullptr, 0, 0, nullptr};
}

// What cp.async may read besides the tables' payloads: a tier's payload.
void add_readable(std::vector<simt::Region>& readable, const DeviceTier& tier) {
  if (tier.dir != nullptr) readable.push_back({tier.payload, tier.payload + tier.payload_bytes});
}

int finish(const std::string& failure, const int32_t* error, char* message, int message_len) {
  if (failure.empty()) return *error;
  std::snprintf(message, static_cast<size_t>(message_len), "%s", failure.c_str());
  return -1;
}

// Runs the kernel of the table's chunk width (k16, k32 or k64) on `blocks` blocks of `warps`
// warps, each warp with the shared memory the launchers of csrc/cuda give it; cp.async may read
// the payload and the tier's payload only.
template <class Args, class Kernel16, class Kernel32, class Kernel64>
std::string run(const Args& a, const Staging& st, int blocks, int warps, int64_t smem_per_warp,
                Kernel16 k16, Kernel32 k32, Kernel64 k64) {
  const auto smem = static_cast<size_t>(warps * smem_per_warp);
  const uint8_t* payload = a.table.view.payload;
  std::vector<simt::Region> readable{{payload, payload + a.table.payload_bytes}};
  add_readable(readable, a.tier);
  const int threads = warps * kWarpSize;
  switch (a.table.view.chunk_bits) {
    case 16: return simt::launch(blocks, threads, smem, readable, k16, a, st);
    case 32: return simt::launch(blocks, threads, smem, readable, k32, a, st);
    default: return simt::launch(blocks, threads, smem, readable, k64, a, st);
  }
}

}  // namespace

extern "C" {

// launch_shape.h's choice for a kernel plan and an amount of work: the blocks, and the warps per
// block in *warps.
int64_t simt_launch_shape(int max_warps, int64_t resident_blocks, int sms, int64_t work_items,
                          int* warps) {
  const WorkShape shape = shape_for_work(max_warps, resident_blocks, sms, work_items);
  *warps = shape.warps_per_block;
  return shape.blocks;
}

// out[perm[i]] = row(ids[i]) for ascending ids (perm may be null: out[i]); ids null: row i.
// decode == 0: the copy-without-decode mode (a compressed row's slot bytes, verbatim). tier: the
// table's HBM tier (host memory here), or null.
int simt_gather(const uint8_t* payload, int64_t payload_bytes, const int64_t* block_base,
                const uint8_t* row_units, const int32_t* bitmask, const uint64_t* mask,
                const uint64_t* bitval, int64_t bitval_len, int64_t num_rows, int64_t row_bytes,
                int64_t unit_bytes, int chunk_bits, const DeviceTier* tier, const int64_t* ids,
                const int64_t* perm, int64_t n, uint8_t* out, int decode, int blocks, int warps,
                int async, char* message, int message_len) {
  int32_t error = 0;
  const DeviceTable table =
      table_of(payload, payload_bytes, block_base, row_units, bitmask, mask, bitval, bitval_len,
               num_rows, row_bytes, unit_bytes, chunk_bits);
  const GatherArgs a{table, tier_or_none(tier), ids, perm, n, out, &error};
  const Staging st{stage_buffer_bytes(row_bytes, unit_bytes), async != 0};
  const int64_t per_warp = gather_smem_per_warp(st.buffer_bytes);
  const std::string failure = decode != 0
                                  ? run(a, st, blocks, warps, per_warp, gather_kernel<16, true>,
                                        gather_kernel<32, true>, gather_kernel<64, true>)
                                  : run(a, st, blocks, warps, per_warp, gather_kernel<16, false>,
                                        gather_kernel<32, false>, gather_kernel<64, false>);
  return finish(failure, &error, message, message_len);
}

// The pooled lookups of lookup.h of `num_parts` parts over `num_tables` tables of one chunk
// width, in one launch (pooled_kernel.cuh's PooledArgs): the tables' arguments are arrays, one
// entry per table; part k pools `bag_count[k]` bags from `first_bag[k]` with table
// `part_table[k]` into out[k], [bag_count[k], pooled_dim]. `single` != 0: one table, passed
// by value (PooledArgs::single), as the op of one table launches it. tiers: one per table (a null
// residency map: none), or null; not with `single` (the op of one table reads no tier).
int simt_pooled(int num_tables, const uint8_t* const* payload, const int64_t* payload_bytes,
                const int64_t* const* block_base, const uint8_t* const* row_units,
                const int32_t* const* bitmask, const uint64_t* const* mask,
                const uint64_t* const* bitval, const int64_t* bitval_len, const int64_t* num_rows,
                const int64_t* row_bytes, const int64_t* unit_bytes, int chunk_bits,
                const DeviceTier* tiers, const int* dtype, int single, int num_parts,
                const int32_t* part_table, const int64_t* first_bag, const int64_t* bag_count,
                float* const* out, int pooling, const int64_t* ids, const int64_t* offsets,
                int64_t num_offset_bags, int64_t nnz, const float* weights, int blocks, int warps,
                int async, char* message, int message_len) {
  if (num_parts > kMaxPooledParts || (single != 0 && (num_tables != 1 || tiers != nullptr))) {
    std::snprintf(message, static_cast<size_t>(message_len), "bad launch");
    return -1;
  }
  int32_t error = 0;
  std::vector<PooledTable> tables;
  PooledShape shape{0, 0, 0};
  std::vector<simt::Region> readable;
  for (int k = 0; k < num_tables; ++k) {
    const DeviceTable table =
        table_of(payload[k], payload_bytes[k], block_base[k], row_units[k], bitmask[k], mask[k],
                 bitval[k], bitval_len[k], num_rows[k], row_bytes[k], unit_bytes[k], chunk_bits);
    const auto dt = static_cast<DType>(dtype[k]);
    tables.push_back(PooledTable{table, dt, pooled_dim(dt, row_bytes[k])});
    shape.stage_bytes =
        std::max(shape.stage_bytes, stage_buffer_bytes(row_bytes[k], unit_bytes[k]));
    shape.rowbuf_bytes = std::max(shape.rowbuf_bytes, rowbuf_bytes(table.view));
    shape.dim = std::max(shape.dim, tables.back().dim);
    readable.push_back({payload[k], payload[k] + payload_bytes[k]});
    if (tiers != nullptr) add_readable(readable, tiers[k]);
  }
  PooledArgs a{};
  a.tables = single != 0 ? nullptr : tables.data();
  a.single = tables[0];
  a.tiers = tiers;
  a.num_parts = num_parts;
  a.bag_start[0] = 0;
  for (int k = 0; k < num_parts; ++k) {
    a.part_table[k] = part_table[k];
    a.first_bag[k] = first_bag[k];
    a.bag_start[k + 1] = a.bag_start[k] + bag_count[k];
    a.out[k] = out[k];
  }
  a.max_dim = shape.dim;
  a.ids = ids;
  a.offsets = offsets;
  a.num_offset_bags = num_offset_bags;
  a.nnz = nnz;
  a.weights = weights;
  a.pooling = static_cast<Pooling>(pooling);
  a.error = &error;
  const Staging st{shape.stage_bytes, async != 0};
  const auto smem = static_cast<size_t>(warps * pooled_smem_per_warp(shape));
  const int threads = warps * kWarpSize;
  std::string failure;
  switch (chunk_bits) {
    case 16:
      failure = simt::launch(blocks, threads, smem, readable, pooled_kernel<16>, a, st, shape);
      break;
    case 32:
      failure = simt::launch(blocks, threads, smem, readable, pooled_kernel<32>, a, st, shape);
      break;
    default:
      failure = simt::launch(blocks, threads, smem, readable, pooled_kernel<64>, a, st, shape);
  }
  return finish(failure, &error, message, message_len);
}

}  // extern "C"
