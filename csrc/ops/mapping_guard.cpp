// SPDX-License-Identifier: Apache-2.0
//
// NOTE(tables): a served table file is read through a memory mapping, and a file shortened in
// place (an operator's `cp` over it, `truncate`, an rsync --inplace) makes every mapped page past
// its new end raise SIGBUS on the next read, which kills the process: every replica that maps
// the file dies at once. The guard turns that into a refusal: a SIGBUS inside a guarded range
// maps zero pages over the rest of the range (the read runs again and gets zeros) and counts the
// fault against the range; the engine checks the counts of the tables a request read before it
// answers, and refuses the request rather than serve the zeros, until the reload poll withdraws
// the table (tables/mapped_files.py). A SIGBUS anywhere else goes to the handler that was there
// before (the default kills the process, as without the guard).
#include "mapping_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace ibpembed {
namespace {

struct GuardedRange {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};  // 0: a free slot
  std::atomic<int64_t> faults{0};
};

// A server maps one file per table and version held: a few hundred at most.
constexpr int kMaxGuarded = 4096;
GuardedRange g_ranges[kMaxGuarded];
std::atomic<int> g_slots_used{0};  // the handler scans [0, used)
std::atomic<int64_t> g_faults{0};
uintptr_t g_page_mask = 0;  // set before the handler is installed (sysconf is not signal-safe)
struct sigaction g_previous{};
std::mutex g_registry;  // registration only: the handler takes no lock

// Async-signal-safe: atomics and mmap/sigaction system calls only.
void on_sigbus(int /*signal*/, siginfo_t* info, void* /*context*/) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const int used = g_slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    GuardedRange& range = g_ranges[i];
    const uintptr_t end = range.end.load(std::memory_order_acquire);
    if (end == 0 || address < range.begin.load(std::memory_order_acquire) || address >= end) {
      continue;
    }
    const uintptr_t page = address & g_page_mask;
    void* zeros = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (zeros == MAP_FAILED) break;
    range.faults.fetch_add(1, std::memory_order_release);
    g_faults.fetch_add(1, std::memory_order_release);
    return;
  }
  // Not ours: the previous disposition sees the fault when the read runs again.
  sigaction(SIGBUS, &g_previous, nullptr);
}

}  // namespace

void install_mapping_guard() {
  std::lock_guard<std::mutex> lock(g_registry);
  static bool installed = false;
  if (installed) return;
  g_page_mask = ~(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)) - 1);
  struct sigaction action{};
  action.sa_sigaction = &on_sigbus;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
  installed = true;
}

int guard_mapping(uintptr_t begin, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_registry);
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = begin & ~(page - 1);
  const uintptr_t end = (begin + bytes + page - 1) & ~(page - 1);
  const int used = g_slots_used.load(std::memory_order_relaxed);
  int slot = 0;
  while (slot < used && g_ranges[slot].end.load(std::memory_order_relaxed) != 0) ++slot;
  if (slot == kMaxGuarded) return -1;
  GuardedRange& range = g_ranges[slot];
  range.faults.store(0, std::memory_order_relaxed);
  range.begin.store(first, std::memory_order_release);
  range.end.store(end, std::memory_order_release);
  if (slot == used) g_slots_used.store(used + 1, std::memory_order_release);
  return slot;
}

void unguard_mapping(int slot) {
  std::lock_guard<std::mutex> lock(g_registry);
  if (slot < 0 || slot >= g_slots_used.load(std::memory_order_relaxed)) return;
  g_ranges[slot].end.store(0, std::memory_order_release);
  g_ranges[slot].begin.store(0, std::memory_order_release);
}

int64_t mapping_faults_at(uintptr_t address) {
  const int used = g_slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    const GuardedRange& range = g_ranges[i];
    const uintptr_t end = range.end.load(std::memory_order_acquire);
    if (end != 0 && address >= range.begin.load(std::memory_order_acquire) && address < end) {
      return range.faults.load(std::memory_order_acquire);
    }
  }
  return 0;
}

int64_t mapping_faults_total() { return g_faults.load(std::memory_order_acquire); }

}  // namespace ibpembed
