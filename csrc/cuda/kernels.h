// SPDX-License-Identifier: Apache-2.0
//
// The interface between the CUDA op bindings (csrc/ops/lookup_ops_cuda.cpp, compiled by g++)
// and the kernels (csrc/cuda/*.cu, compiled by nvcc): plain structs of device pointers and one
// launcher per kernel family. Torch-free, so the kernels build with lean headers only.
//
// Every kernel validates what it reads and reports problems through an error word (ErrorBits,
// OR-ed in with atomicOr) instead of trapping; a warp that meets a bad index, bag or slot skips it,
// so invalid input can never make a kernel read outside the tensors it was given. The host reads
// the word once after the launch and raises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed::gpu {

enum ErrorBits : int32_t {
  kErrIndex = 1,    // an index outside [0, num_rows)
  kErrOffsets = 2,  // offsets not 0 .. nnz, non-decreasing
  kErrTable = 4,    // index, masks or slot sizes inconsistent with the payload
};

// A table whose pointers the device can dereference. view.payload is either device memory or the
// device alias of pinned host memory (zero-copy); it must be 16-byte aligned.
struct DeviceTable {
  TableView view;
  int64_t payload_bytes;  // readable bytes at view.payload
};

// A table's HBM tier (service/ibpembed/engine/hbm_tier.py): copies of its hottest rows in device
// memory, found through a residency map. A row the map holds is read from `payload` (HBM), every
// other row from the table's payload (zero-copy over PCIe), in the same launch. dir == nullptr:
// no tier. The slots are exact copies of what the table serves for the rows, so results do not
// depend on the tier.
//
// The map is the rank directory of ibpembed/tier.h (rank_slot: 16 bytes per 64 table rows, slots
// in row order), which the CPU's decoded tier reads too. Slot s lies in `payload` at
//   decoded form: s * round16(row_bytes), round16(row_bytes) bytes (a fixed stride: no offsets);
//   compressed form: [slot_offset[s], slot_offset[s + 1]) (slots vary in size).
// The kernels check every slot the directory yields against num_slots and every window against
// payload_bytes, so a corrupt directory or offset is reported (kErrTable), never read through.
struct DeviceTier {
  const uint64_t* dir;         // [2 * ceil(num_rows / 64)]
  const int64_t* slot_offset;  // [num_slots + 1] (compressed form); nullptr (decoded form)
  const uint8_t* payload;      // device memory, 16-byte aligned
  int64_t payload_bytes;       // readable bytes at payload (kPayloadPad past the last slot)
  int64_t num_slots;
  // [2] on the device: ids the residency map sent to the tier, and to host memory (a sorted
  // gather resolves a run of equal ids once); nullptr: not counted.
  unsigned long long* counters;
};

enum TierCounter : int { kTierHits = 0, kTierMisses = 1 };

// out[dst(i)] = row(ids[i]) for i < n, where ids is sorted ascending and dst(i) = perm[i]
// (perm == nullptr: dst(i) = i). ids == nullptr means ids[i] = i (whole-table decompress).
struct GatherArgs {
  DeviceTable table;
  DeviceTier tier;
  const int64_t* ids;
  const int64_t* perm;
  int64_t n;
  uint8_t* out;  // [n, row_bytes]
  int32_t* error;
};

// One table of a pooled launch: how to decode its rows and how they pool.
struct PooledTable {
  DeviceTable table;
  DType dtype;
  int64_t dim;  // pooled_dim(dtype, row_bytes) > 0
};

// Parts one pooled launch can hold (kernel parameters are limited to 4 KB).
inline constexpr int kMaxPooledParts = 48;

// The pooled lookups of lookup.h over one CSR batch (ids, offsets, weights), for up to
// kMaxPooledParts parts of tables of one chunk width in one launch: part k pools bags
// [first_bag[k], first_bag[k] + bag_start[k + 1] - bag_start[k]) of `offsets` with table
// part_table[k] of `tables` (or `single` when `tables` is null) into out[k], [its bags, dim].
// The launch's bags are numbered part after part (bag_start, prefix sums of the parts' bag
// counts); warps take them with a grid stride, ids in request order.
struct PooledArgs {
  const PooledTable* tables;  // device array, or nullptr: every part reads `single`
  PooledTable single;
  // The tables' HBM tiers: a device array parallel to `tables` (nullptr: no table has one;
  // `single` has none). Device memory, not a parameter: a pointer into the kernel's parameters
  // would make the compiler copy all of them to local memory.
  const DeviceTier* tiers;
  int num_parts;
  int32_t part_table[kMaxPooledParts];
  int64_t first_bag[kMaxPooledParts];
  int64_t bag_start[kMaxPooledParts + 1];
  float* out[kMaxPooledParts];
  int64_t max_dim;  // largest dim of the parts' tables (the accumulators' size)
  const int64_t* ids;
  const int64_t* offsets;   // [num_offset_bags + 1]
  int64_t num_offset_bags;  // bags of the whole batch, which the parts' bags lie in
  int64_t nnz;
  const float* weights;  // nullptr: every weight is 1
  Pooling pooling;
  int32_t* error;
};

IBP_HD int64_t round16(int64_t bytes) { return (bytes + 15) & ~int64_t{15}; }

// A pooled launch's decoded row: V whole chunks, plus 16 bytes of read slack for the funnel
// reads of the accumulate loop.
IBP_HD int64_t rowbuf_bytes(const TableView& t) {
  return round16(static_cast<int64_t>(t.num_chunks) * (t.chunk_bits / 8)) + 16;
}

// Shared-memory shape of a pooled launch: the largest staging buffer, decoded row and
// accumulator row among its tables.
struct PooledShape {
  int64_t stage_bytes;
  int64_t rowbuf_bytes;
  int64_t dim;
};

// Radix sort of ids[0, n) (n < 2^31) by their low `bits` bits, carrying positions[] along into
// perm[] (sort.cu); sort_ids_temp_bytes() sizes `temp`. Runs on `stream`, returns at once.
size_t sort_ids_temp_bytes(int64_t n, int bits);
void sort_ids(const int64_t* ids, int64_t* sorted, const int64_t* positions, int64_t* perm,
              int64_t n, int bits, void* temp, size_t temp_bytes, cudaStream_t stream);

// Launch on `stream`; throw c10::Error on a launch failure or a row too wide for shared memory.
void launch_gather(const GatherArgs& args, cudaStream_t stream);
// Every part's table has chunk width `chunk_bits`; `shape` covers every part's table.
void launch_pooled(const PooledArgs& args, int chunk_bits, const PooledShape& shape,
                   cudaStream_t stream);

}  // namespace ibpembed::gpu
