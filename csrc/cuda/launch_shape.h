// SPDX-License-Identifier: Apache-2.0
//
// How many warps a block gets and how many blocks a launch has, for a given amount of work:
// plain host arithmetic (no CUDA, no torch), shared by launch_plan.cuh and the SIMT emulator's
// tests, which check it on the CPU.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ibpembed::gpu {

struct WorkShape {
  int warps_per_block;
  int64_t blocks;
};

// The kernel's plan allows `max_warps` warps per block and `resident_blocks` such blocks on the
// device at once (`sms` multiprocessors). Work items (rows, bags) go one per warp with a grid
// stride. Small work is spread over the multiprocessors rather than packed into a few full
// blocks: blocks are halved (down to one warp) while the work would fill fewer blocks than there
// are multiprocessors, so a 1k-id pooled call of 64 bags runs on 64 SMs, not 8. Smaller blocks
// fit more per SM, so the resident limit grows by the same factor.
inline WorkShape shape_for_work(int max_warps, int64_t resident_blocks, int sms,
                                int64_t work_items) {
  int warps = std::max(1, max_warps);
  auto blocks_for = [&](int w) { return (work_items + w - 1) / w; };
  while (warps > 1 && blocks_for(warps) < sms) warps /= 2;
  const int64_t resident = resident_blocks * (std::max(1, max_warps) / warps);
  return WorkShape{warps, std::max<int64_t>(1, std::min(blocks_for(warps), resident))};
}

}  // namespace ibpembed::gpu
