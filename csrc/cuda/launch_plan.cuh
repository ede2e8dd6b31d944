// SPDX-License-Identifier: Apache-2.0
//
// Host-side launch planning of the CUDA kernels: how rows are staged (IBPEMBED_CUDA_STAGING), how
// many warps a block gets within the device's shared memory, and how many blocks fill the device.
// Included by the .cu files that launch kernels, never by the kernel headers (which also compile
// for the host SIMT emulator of tools/simt).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <vector>

#include "launch_shape.h"
#include "row_pipeline.cuh"

namespace ibpembed::gpu {

// IBPEMBED_CUDA_STAGING=sync swaps cp.async for plain 16-byte loads and stores (the warp then
// waits for each row before decoding the previous one): the A/B switch gpu_check uses to see
// whether asynchronous staging pays, and a fallback for a platform whose cp.async cannot read
// mapped host memory. Read at every launch, so a process can switch.
inline Staging staging_with(int64_t buffer_bytes) {
  const char* mode = std::getenv("IBPEMBED_CUDA_STAGING");
  const std::string_view m = mode != nullptr ? mode : "async";
  TORCH_CHECK(m == "async" || m == "sync", "IBPEMBED_CUDA_STAGING must be 'async' or 'sync', got '",
              m, "'");
  return Staging{buffer_bytes, m == "async"};
}

// IBPEMBED_CUDA_DECODE=copy launches the gather's copy-without-decode mode (gather_kernel.cuh):
// a timing baseline for gpu_check, never a lookup (its rows are slot bytes, not the table's).
// Read at every launch, so a process can switch.
inline bool decode_rows() {
  const char* mode = std::getenv("IBPEMBED_CUDA_DECODE");
  const std::string_view m = mode != nullptr ? mode : "decode";
  TORCH_CHECK(m == "decode" || m == "copy",
              "IBPEMBED_CUDA_DECODE must be 'decode' or 'copy', got '", m, "'");
  return m == "decode";
}

inline Staging staging_for(const TableView& t) {
  return staging_with(stage_buffer_bytes(t.row_bytes, t.unit_bytes));
}

// Block shape and residency of one kernel on one device for one shared-memory need per warp.
struct LaunchPlan {
  int warps_per_block;
  size_t smem_bytes;
  int64_t resident_blocks;  // blocks that fit on the whole device at once
  int sms;                  // multiprocessors of the device
};

// Most warps per block (up to kMaxWarpsPerBlock) whose shared memory fits the device, and how
// many such blocks the device holds at the occupancy that leaves.
template <class Kernel>
LaunchPlan compute_plan(Kernel kernel, int device, int64_t smem_per_warp) {
  int optin = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TORCH_CHECK(smem_per_warp <= optin, "ibpembed CUDA: rows of this table need ", smem_per_warp,
              " bytes of shared memory per warp, more than the ", optin,
              " this GPU allows per block; use the CPU path for such wide rows");
  int warps = kMaxWarpsPerBlock;
  while (warps > 1 && warps * smem_per_warp > optin) warps /= 2;
  const auto smem = static_cast<size_t>(warps * smem_per_warp);
  // The opt-in maximum once for all tables: a launch still gets only the shared memory it asks
  // for, so smaller tables keep their L1.
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  int per_sm = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * kWarpSize, smem));
  return LaunchPlan{warps, smem, static_cast<int64_t>(std::max(per_sm, 1)) * sms, sms};
}

struct LaunchShape {
  int warps_per_block;
  int blocks;
  size_t smem_bytes;
};

// The launch for `work_items` items (rows or bags): the kernel's plan on the current device, its
// blocks sized to the work (shape_for_work: small work spread over every SM in smaller blocks),
// no more blocks than the work needs (warps loop over items with a grid stride). Plans are
// computed once per kernel, device and shared-memory need: the driver queries behind them cost
// microseconds, a visible share of a small batch.
template <class Kernel>
LaunchShape plan_launch(Kernel kernel, int64_t smem_per_warp, int64_t work_items) {
  struct Entry {
    const void* kernel;
    int device;
    int64_t smem_per_warp;
    LaunchPlan plan;
  };
  static std::mutex mutex;
  static std::vector<Entry> plans;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto* id = reinterpret_cast<const void*>(kernel);
  LaunchPlan plan{};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = std::find_if(plans.begin(), plans.end(), [&](const Entry& e) {
      return e.kernel == id && e.device == device && e.smem_per_warp == smem_per_warp;
    });
    if (it != plans.end()) {
      plan = it->plan;
    } else {
      plan = compute_plan(kernel, device, smem_per_warp);
      plans.push_back(Entry{id, device, smem_per_warp, plan});
    }
  }
  const WorkShape shape =
      shape_for_work(plan.warps_per_block, plan.resident_blocks, plan.sms, work_items);
  const auto smem = static_cast<size_t>(shape.warps_per_block * smem_per_warp);
  return LaunchShape{shape.warps_per_block, static_cast<int>(shape.blocks), smem};
}

}  // namespace ibpembed::gpu
