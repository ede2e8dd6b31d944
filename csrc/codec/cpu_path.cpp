// SPDX-License-Identifier: Apache-2.0
//
// Picks the CPU path once, at load time, from a CPU-feature check (never at build time), with an
// environment override. Having BMI2 does not make it fast (AMD before Zen 3 runs pdep/pext in
// microcode), hence IBPEMBED_CPU_PATH=ref.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ibpembed/codec.h"

namespace ibpembed {
namespace {

CpuPath initial_path() {
  const char* env = std::getenv("IBPEMBED_CPU_PATH");
  if (env != nullptr && *env != '\0') {
    if (std::strcmp(env, "ref") == 0) return CpuPath::kRef;
    if (std::strcmp(env, "bmi2") == 0) {
      if (!cpu_has_bmi2()) {
        throw std::runtime_error("IBPEMBED_CPU_PATH=bmi2 but this CPU has no BMI2");
      }
      return CpuPath::kBmi2;
    }
    throw std::runtime_error(std::string("IBPEMBED_CPU_PATH must be 'ref' or 'bmi2', got '") +
                             env + "'");
  }
  return cpu_has_bmi2() ? CpuPath::kBmi2 : CpuPath::kRef;
}

std::atomic<CpuPath>& active() {
  static std::atomic<CpuPath> path{initial_path()};
  return path;
}

}  // namespace

bool cpu_has_bmi2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

CpuPath active_cpu_path() { return active().load(std::memory_order_relaxed); }

void set_active_cpu_path(CpuPath path) {
  if (path == CpuPath::kBmi2 && !cpu_has_bmi2()) {
    throw std::runtime_error("cannot select the bmi2 CPU path: this CPU has no BMI2");
  }
  active().store(path, std::memory_order_relaxed);
}

const char* cpu_path_name(CpuPath path) { return path == CpuPath::kBmi2 ? "bmi2" : "ref"; }

const RowKernels& row_kernels(CpuPath path) {
  return path == CpuPath::kBmi2 ? bmi2_row_kernels() : ref_row_kernels();
}

}  // namespace ibpembed
