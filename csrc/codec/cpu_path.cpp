// SPDX-License-Identifier: Apache-2.0
//
// Picks the CPU path once, at load time, from a CPU-feature check (never at build time), with an
// environment override; the same for the table size above which decode_rows stages its rows.
// Having BMI2 does not make pdep fast: AMD before Zen 3 runs pdep/pext in microcode, dozens of
// cycles per mask bit (published instruction tables; no such CPU was at hand to measure), where
// the ref path's run-wise deposit takes a few cycles per run. So those CPUs default to ref.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include "ibpembed/codec.h"

namespace ibpembed {
namespace {

constexpr CpuPath kAllPaths[] = {CpuPath::kRef, CpuPath::kBmi2, CpuPath::kAvx512};

CpuPath initial_path() {
  const char* env = std::getenv("IBPEMBED_CPU_PATH");
  if (env == nullptr || *env == '\0') return default_cpu_path();
  CpuPath path;
  if (!cpu_path_from_name(env, &path)) {
    throw std::runtime_error(
        std::string("IBPEMBED_CPU_PATH must be 'ref', 'bmi2' or 'avx512', got '") + env + "'");
  }
  if (!cpu_supports(path)) {
    throw std::runtime_error(std::string("IBPEMBED_CPU_PATH=") + env +
                             " but this CPU lacks the instructions it needs");
  }
  return path;
}

std::atomic<CpuPath>& active() {
  static std::atomic<CpuPath> path{initial_path()};
  return path;
}

PatternLookup initial_pattern_lookup() {
  const char* env = std::getenv("IBPEMBED_PATTERN_LOOKUP");
  if (env == nullptr || *env == '\0') return default_pattern_lookup();
  PatternLookup lookup;
  if (!pattern_lookup_from_name(env, &lookup)) {
    throw std::runtime_error(
        std::string("IBPEMBED_PATTERN_LOOKUP must be 'gather' or 'tables', got '") + env + "'");
  }
  return lookup;
}

std::atomic<PatternLookup>& active_lookup() {
  static std::atomic<PatternLookup> lookup{initial_pattern_lookup()};
  return lookup;
}

const char* stage_min_bytes_override() {
  const char* env = std::getenv("IBPEMBED_STAGE_MIN_BYTES");
  return env == nullptr || *env == '\0' ? nullptr : env;
}

int64_t cache_bytes(int level, int64_t fallback) {
  const long bytes = sysconf(level);
  return bytes > 0 ? bytes : fallback;
}

int64_t initial_stage_min_bytes() {
  const char* env = stage_min_bytes_override();
  if (env == nullptr) return default_stage_min_bytes();
  char* end = nullptr;
  const long long bytes = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || bytes < 0) {
    throw std::runtime_error(
        std::string("IBPEMBED_STAGE_MIN_BYTES must be a byte count >= 0, got '") + env + "'");
  }
  return bytes;
}

std::atomic<int64_t>& active_stage_min_bytes() {
  static std::atomic<int64_t> bytes{initial_stage_min_bytes()};
  return bytes;
}

}  // namespace

int64_t default_stage_min_bytes() {
  return cache_bytes(_SC_LEVEL3_CACHE_SIZE, cache_bytes(_SC_LEVEL2_CACHE_SIZE, int64_t{32} << 20));
}

void set_served_payload_bytes(int64_t bytes) {
  if (stage_min_bytes_override() != nullptr) return;
  const int64_t llc = default_stage_min_bytes();
  const int64_t l2 = cache_bytes(_SC_LEVEL2_CACHE_SIZE, int64_t{2} << 20);
  set_stage_min_bytes(bytes > llc ? std::min(llc, l2) : llc);
}

int64_t stage_min_bytes() { return active_stage_min_bytes().load(std::memory_order_relaxed); }

void set_stage_min_bytes(int64_t bytes) {
  active_stage_min_bytes().store(bytes, std::memory_order_relaxed);
}

bool cpu_has_bmi2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

bool cpu_has_microcoded_pdep() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_is("znver1") || __builtin_cpu_is("znver2");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__)
  // __builtin_cpu_supports also checks that the OS saves the AVX-512 register state.
  return cpu_has_bmi2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512vbmi2");
#else
  return false;
#endif
}

CpuPath default_cpu_path() {
  if (cpu_has_avx512()) return CpuPath::kAvx512;
  return cpu_has_bmi2() && !cpu_has_microcoded_pdep() ? CpuPath::kBmi2 : CpuPath::kRef;
}

bool cpu_supports(CpuPath path) {
  switch (path) {
    case CpuPath::kAvx512: return cpu_has_avx512();
    case CpuPath::kBmi2: return cpu_has_bmi2();
    default: return true;
  }
}

CpuPath active_cpu_path() { return active().load(std::memory_order_relaxed); }

void set_active_cpu_path(CpuPath path) {
  if (!cpu_supports(path)) {
    throw std::runtime_error(std::string("cannot select the ") + cpu_path_name(path) +
                             " CPU path: this CPU lacks the instructions it needs");
  }
  active().store(path, std::memory_order_relaxed);
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::kAvx512: return "avx512";
    case CpuPath::kBmi2: return "bmi2";
    default: return "ref";
  }
}

bool cpu_path_from_name(const char* name, CpuPath* path) {
  for (const CpuPath candidate : kAllPaths) {
    if (std::strcmp(name, cpu_path_name(candidate)) == 0) {
      *path = candidate;
      return true;
    }
  }
  return false;
}

#if defined(__x86_64__) || defined(__i386__)
static bool gathers_slowed_by_microcode() {
  std::ifstream status("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling");
  std::string line;
  return std::getline(status, line) && line.rfind("Mitigation: Microcode", 0) == 0;
}
#endif

// NOTE(codec): Intel cores from Skylake to Tiger Lake, once the microcode that mitigates Gather
// Data Sampling is loaded, run every vector gather several times slower (Intel's guidance on
// the mitigation); those take the byte tables. Sapphire Rapids and later are not affected.
PatternLookup default_pattern_lookup() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_is("intel") && !gathers_slowed_by_microcode() ? PatternLookup::kGather
                                                                     : PatternLookup::kByteTables;
#else
  return PatternLookup::kByteTables;
#endif
}

PatternLookup active_pattern_lookup() { return active_lookup().load(std::memory_order_relaxed); }

void set_active_pattern_lookup(PatternLookup lookup) {
  active_lookup().store(lookup, std::memory_order_relaxed);
}

const char* pattern_lookup_name(PatternLookup lookup) {
  return lookup == PatternLookup::kGather ? "gather" : "tables";
}

bool pattern_lookup_from_name(const char* name, PatternLookup* lookup) {
  for (const PatternLookup candidate : {PatternLookup::kGather, PatternLookup::kByteTables}) {
    if (std::strcmp(name, pattern_lookup_name(candidate)) == 0) {
      *lookup = candidate;
      return true;
    }
  }
  return false;
}

const RowKernels& row_kernels(CpuPath path) {
  switch (path) {
#if defined(__x86_64__)
    // Built on x86-64 only (setup.py); cpu_supports() never admits them elsewhere.
    case CpuPath::kAvx512: return avx512_row_kernels();
    case CpuPath::kBmi2: return bmi2_row_kernels();
#endif
    default: return ref_row_kernels();
  }
}

}  // namespace ibpembed
