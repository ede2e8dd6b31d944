// SPDX-License-Identifier: Apache-2.0
//
// A host SIMT emulator for the ibpembed CUDA kernels, so that CI executes their device code
// without a GPU: force-included (g++ -include simt.h -DIBPEMBED_SIMT) before csrc/cuda's kernel
// headers. Every thread of a block is a host thread; a warp's 32 threads meet in each collective
// (__shfl_sync, __ballot_sync, ...) the way a converged warp does, and the emulator checks what the
// hardware assumes instead of diagnosing:
//   - every lane of a warp reaches the same collective (full masks only): a lane that calls another
//     one, or exits while the others wait, fails the launch ("divergent"), and a warp whose lanes
//     never all arrive fails it after a timeout ("deadlock");
//   - cp.async copies land only when cp.async.wait_group retires their group, oldest first, and
//     their 16 destination bytes turn to a poison pattern when the copy is issued (on hardware
//     they are undefined until the wait), so a kernel that reads a staging buffer before waiting
//     for it reads poison even where the buffer held the same row before (a ring of buffers, a
//     hot id); shared memory also starts as poison, so reading bytes nothing wrote shows up as a
//     wrong row;
//   - each cp.async must read 16 aligned bytes inside a registered device buffer (the payload) and
//     write 16 aligned bytes inside the block's shared memory.
// What it cannot show: timing, the memory model of real hardware (it is stronger here: threads
// meet under a mutex), PCIe and zero-copy behaviour, or anything about performance.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

namespace simt {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// A collective that ended the launch; unwinds the lane's kernel call.
struct Abort {};

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
// A warp whose lanes have not all arrived by then is deadlocked (the tests' kernels take
// milliseconds per collective at most). Settable, so the self-test of the check is quick.
inline std::chrono::milliseconds deadlock_timeout{30000};
// How often a waiting lane looks whether the launch failed elsewhere.
inline constexpr auto kPoll = std::chrono::milliseconds(20);

enum class Op : int { kSync, kShfl, kShflUp, kBallot, kAny, kReduceAdd };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kSync: return "__syncwarp";
    case Op::kShfl: return "__shfl_sync";
    case Op::kShflUp: return "__shfl_up_sync";
    case Op::kBallot: return "__ballot_sync";
    case Op::kAny: return "__any_sync";
    case Op::kReduceAdd: return "__reduce_add_sync";
  }
  return "?";
}

// The state of one launch: its first failure, which every waiting lane polls for.
class Launch {
 public:
  bool failed() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return !message_.empty();
  }
  std::string message() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return message_;
  }
  // Records the first failure; waiting lanes see it within kPoll and unwind.
  void fail(const std::string& what) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (message_.empty()) message_ = what;
  }

 private:
  mutable std::mutex mutex_;
  std::string message_;
};

inline Launch* current_launch = nullptr;

// 32 lanes meeting in collectives. One phase per collective: the last lane to arrive computes
// every lane's result and opens the next generation; a lane reads its result before it can arrive
// at the next collective, so results are never overwritten early.
class Warp {
 public:
  Warp(int block, int index) : block_(block), index_(index) {}

  uint64_t collective(Op op, int lane, uint64_t value, unsigned arg, unsigned mask) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (current_launch->failed()) throw Abort{};
    if (mask != kFullMask) fail_locked(std::string(op_name(op)) + " with a partial mask");
    if (exited_ > 0) {
      fail_locked(std::string(op_name(op)) + " after " + std::to_string(exited_) +
                  " lane(s) of the warp exited (divergent)");
    }
    if (arrived_ == 0) {
      op_ = op;
    } else if (op_ != op) {
      fail_locked(std::string("lane ") + std::to_string(lane) + " called " + op_name(op) +
                  " while other lanes wait in " + op_name(op_) + " (divergent)");
    }
    values_[lane] = value;
    args_[lane] = arg;
    if (++arrived_ == kWarpSize) {
      compute();
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      const uint64_t generation = generation_;
      const auto deadline = std::chrono::steady_clock::now() + deadlock_timeout;
      while (generation_ == generation && !current_launch->failed() &&
             std::chrono::steady_clock::now() < deadline) {
        cv_.wait_for(lock, kPoll);
      }
      if (current_launch->failed()) throw Abort{};
      if (generation_ == generation) {
        fail_locked(std::string("deadlock: ") + std::to_string(arrived_) + " of 32 lanes in " +
                    op_name(op_) + ", the others never came");
      }
    }
    return results_[lane];
  }

  void lane_exited(int lane) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++exited_;
    if (arrived_ > 0 && !current_launch->failed()) {
      current_launch->fail(where() + "lane " + std::to_string(lane) + " exited while " +
                           std::to_string(arrived_) + " lane(s) wait in " + op_name(op_) +
                           " (divergent)");
    }
  }

 private:
  std::string where() const {
    return "block " + std::to_string(block_) + ", warp " + std::to_string(index_) + ": ";
  }

  [[noreturn]] void fail_locked(const std::string& what) {
    current_launch->fail(where() + what);
    throw Abort{};
  }

  void compute() {
    switch (op_) {
      case Op::kSync: break;
      case Op::kShfl:
        for (int l = 0; l < kWarpSize; ++l) results_[l] = values_[args_[l] % kWarpSize];
        break;
      case Op::kShflUp:
        for (int l = 0; l < kWarpSize; ++l) {
          results_[l] = l >= static_cast<int>(args_[l]) ? values_[l - args_[l]] : values_[l];
        }
        break;
      case Op::kBallot:
      case Op::kAny: {
        uint64_t bits = 0;
        for (int l = 0; l < kWarpSize; ++l) bits |= (values_[l] != 0 ? uint64_t{1} : 0) << l;
        const uint64_t r = op_ == Op::kBallot ? bits : (bits != 0 ? 1 : 0);
        std::fill(results_, results_ + kWarpSize, r);
        break;
      }
      case Op::kReduceAdd: {
        uint32_t sum = 0;
        for (int l = 0; l < kWarpSize; ++l) sum += static_cast<uint32_t>(values_[l]);
        std::fill(results_, results_ + kWarpSize, sum);
        break;
      }
    }
  }

  const int block_;
  const int index_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int exited_ = 0;
  uint64_t generation_ = 0;
  Op op_ = Op::kSync;
  uint64_t values_[kWarpSize] = {};
  unsigned args_[kWarpSize] = {};  // each lane's source lane or delta
  uint64_t results_[kWarpSize] = {};
};

// Byte ranges the device may read with cp.async (the payload), per launch.
struct Region {
  const uint8_t* begin;
  const uint8_t* end;
};

// What each emulated thread knows about itself.
struct ThreadState {
  Warp* warp = nullptr;
  int lane = 0;
  uint8_t* smem = nullptr;
  size_t smem_bytes = 0;
  const std::vector<Region>* readable = nullptr;
  // cp.async: copies of the open group, then the committed groups, oldest first.
  std::vector<std::pair<uint8_t*, const uint8_t*>> open;
  std::vector<std::vector<std::pair<uint8_t*, const uint8_t*>>> committed;
};

inline thread_local ThreadState self;

inline uint64_t collective(Op op, uint64_t value, unsigned arg, unsigned mask) {
  return self.warp->collective(op, self.lane, value, arg, mask);
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 64 bits");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

inline void fail(const std::string& what) {
  current_launch->fail(what);
  throw Abort{};
}

}  // namespace simt

inline thread_local simt::Dim3 threadIdx;
inline thread_local simt::Dim3 blockIdx;
inline thread_local simt::Dim3 blockDim;
inline thread_local simt::Dim3 gridDim;

// ---- warp collectives ------------------------------------------------------------------------

inline void __syncwarp(unsigned mask = simt::kFullMask) {
  simt::collective(simt::Op::kSync, 0, 0, mask);
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = simt::kWarpSize) {
  if (width != simt::kWarpSize) simt::fail("__shfl_sync with a width below 32");
  return simt::from_bits<T>(
      simt::collective(simt::Op::kShfl, simt::to_bits(v), static_cast<unsigned>(src), mask));
}

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = simt::kWarpSize) {
  if (width != simt::kWarpSize) simt::fail("__shfl_up_sync with a width below 32");
  return simt::from_bits<T>(simt::collective(simt::Op::kShflUp, simt::to_bits(v), delta, mask));
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(simt::collective(simt::Op::kBallot, predicate != 0, 0, mask));
}

inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(simt::collective(simt::Op::kAny, predicate != 0, 0, mask));
}

inline unsigned __reduce_add_sync(unsigned mask, unsigned value) {
  return static_cast<unsigned>(simt::collective(simt::Op::kReduceAdd, value, 0, mask));
}

// ---- scalar intrinsics -----------------------------------------------------------------------

inline int __ffs(int x) { return __builtin_ffs(x); }

inline int atomicOr(int32_t* address, int32_t value) {
  return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST);
}

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

// Round-to-nearest float arithmetic; the harness is built with -ffp-contract=off, so no FMA.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

// ---- cp.async and shared memory (row_pipeline.cuh leaves these to the emulator) --------------

// What a cp.async destination holds between the issue and the wait.
inline constexpr uint8_t kCopyPoison = 0xCD;

inline void cp_async16(void* smem, const void* gmem) {
  auto* dst = static_cast<uint8_t*>(smem);
  const auto* src = static_cast<const uint8_t*>(gmem);
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    simt::fail("cp.async of 16 bytes from or to an address not 16-byte aligned");
  }
  if (dst < simt::self.smem || dst + 16 > simt::self.smem + simt::self.smem_bytes) {
    simt::fail("cp.async writes outside the block's shared memory");
  }
  const bool readable =
      std::any_of(simt::self.readable->begin(), simt::self.readable->end(),
                  [&](const simt::Region& r) { return src >= r.begin && src + 16 <= r.end; });
  if (!readable) simt::fail("cp.async reads outside every device buffer of the launch");
  std::memset(dst, kCopyPoison, 16);
  simt::self.open.emplace_back(dst, src);
}

inline void cp_async_commit() {
  simt::self.committed.push_back(std::move(simt::self.open));
  simt::self.open.clear();
}

// Retires the oldest groups until at most N are in flight: only now do their bytes land.
template <int N>
void cp_async_wait() {
  auto& groups = simt::self.committed;
  while (groups.size() > static_cast<size_t>(N)) {
    for (const auto& [dst, src] : groups.front()) std::memcpy(dst, src, 16);
    groups.erase(groups.begin());
  }
}

#define IBP_DYNAMIC_SMEM(name) uint8_t* const name = ::simt::self.smem

namespace simt {

// Byte every block's shared memory starts as, so reads of bytes nothing wrote show.
inline constexpr uint8_t kPoison = 0xCD;

// Runs kernel(args...) on a grid of `blocks` blocks of `threads` threads with `smem_bytes` of
// dynamic shared memory each, one block at a time. `readable` lists the buffers cp.async may read.
// Returns "" or the first failure.
template <class Kernel, class... Args>
std::string launch(int blocks, int threads, size_t smem_bytes, std::vector<Region> readable,
                   Kernel kernel, const Args&... args) {
  if (threads <= 0 || threads % kWarpSize != 0) return "block size must be a multiple of 32";
  Launch state;
  current_launch = &state;
  for (int b = 0; b < blocks && !state.failed(); ++b) {
    // 64-byte aligned, as the CUDA runtime aligns dynamic shared memory.
    const size_t padded = (smem_bytes + 63) / 64 * 64;
    std::unique_ptr<uint8_t[]> storage(new uint8_t[padded + 64]);
    uint8_t* smem = storage.get() + (64 - reinterpret_cast<uintptr_t>(storage.get()) % 64) % 64;
    std::memset(smem, kPoison, padded);
    std::vector<std::unique_ptr<Warp>> warps;
    for (int w = 0; w < threads / kWarpSize; ++w) warps.push_back(std::make_unique<Warp>(b, w));
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads));
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        threadIdx.x = static_cast<unsigned>(t);
        blockIdx.x = static_cast<unsigned>(b);
        blockDim.x = static_cast<unsigned>(threads);
        gridDim.x = static_cast<unsigned>(blocks);
        self = ThreadState{};
        self.warp = warps[static_cast<size_t>(t / kWarpSize)].get();
        self.lane = t % kWarpSize;
        self.smem = smem;
        self.smem_bytes = smem_bytes;
        self.readable = &readable;
        try {
          kernel(args...);
        } catch (const Abort&) {
          return;
        }
        self.warp->lane_exited(self.lane);
      });
    }
    for (std::thread& th : pool) th.join();
  }
  current_launch = nullptr;
  return state.message();
}

}  // namespace simt
