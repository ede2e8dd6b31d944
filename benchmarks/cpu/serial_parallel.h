// SPDX-License-Identifier: Apache-2.0
//
// Stands in for csrc/ops/parallel.h when benchmarks/cpu_engine.py compiles the lookup engine
// without torch: at::parallel_for runs the whole range on the calling thread, which is what the
// engine does on one intra-op thread anyway. Benchmark-only, never part of ibpembed._C.
#pragma once

#include <cstdint>

namespace at {

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t /*grain_size*/, const F& f) {
  if (begin < end) f(begin, end);
}

}  // namespace at
