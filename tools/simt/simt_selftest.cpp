// SPDX-License-Identifier: Apache-2.0
//
// Toy kernels that show the SIMT emulator (simt.h) catches what it claims to catch; a check of the
// CUDA kernels through it means nothing if a broken kernel would pass as well. simt_selftest(case)
// returns the kernel's result (>= 0) or -1 with the emulator's failure in `message`:
//   0  well-formed collectives: a warp sum by shuffles, a ballot and a reduction     -> 0 = right
//   1  lanes of a warp calling different collectives                               -> -1, divergent
//   2  half a warp returning while the other half shuffles                         -> -1, divergent
//   3  a staging buffer read before cp.async.wait_group retires its copy            -> poison byte
//   4  the same read after the wait                                                 -> copied byte
//   5  a cp.async from memory outside every device buffer of the launch            -> -1, outside
//   6  a lane that never reaches its warp's collective                             -> -1, deadlock
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr unsigned kFull = 0xffffffffu;

__global__ void collectives_kernel(int* wrong) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int v = lane;
  for (int d = 16; d > 0; d /= 2) v += __shfl_sync(kFull, v, (lane + d) % 32);
  const unsigned odd = __ballot_sync(kFull, lane % 2);
  const unsigned sum = __reduce_add_sync(kFull, static_cast<unsigned>(lane));
  const int up = __shfl_up_sync(kFull, lane, 3);
  const bool ok =
      v == 496 && odd == 0xaaaaaaaau && sum == 496 && up == (lane >= 3 ? lane - 3 : lane);
  if (!ok) atomicOr(wrong, 1);
}

__global__ void divergent_kernel() {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane < 8) {
    __syncwarp();
  } else {
    (void)__ballot_sync(kFull, 1);
  }
}

__global__ void early_exit_kernel() {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane >= 16) return;
  (void)__shfl_sync(kFull, lane, 0);
}

__global__ void staging_kernel(const uint8_t* src, bool wait, int* seen) {
  IBP_DYNAMIC_SMEM(smem);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  cp_async16(smem + 16 * lane, src + 16 * lane);
  cp_async_commit();
  if (wait) cp_async_wait<0>();
  __syncwarp();
  if (lane == 0) *seen = smem[16 * 5 + 3];
}

__global__ void stray_copy_kernel(const uint8_t* src) {
  IBP_DYNAMIC_SMEM(smem);
  cp_async16(smem, src);
  cp_async_commit();
  cp_async_wait<0>();
}

__global__ void missing_lane_kernel() {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 7) {  // neither reaches the collective nor exits, until the emulator gives up
    while (!simt::current_launch->failed()) std::this_thread::yield();
    return;
  }
  __syncwarp();
}

int finish(const std::string& failure, int result, char* message, int message_len) {
  if (failure.empty()) return result;
  std::snprintf(message, static_cast<size_t>(message_len), "%s", failure.c_str());
  return -1;
}

}  // namespace

extern "C" int simt_selftest(int which, char* message, int message_len) {
  alignas(16) static uint8_t source[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) source[i] = static_cast<uint8_t>(i + 1);
  const std::vector<simt::Region> readable{{source, source + sizeof(source)}};
  int result = 0;
  std::string failure;
  switch (which) {
    case 0: failure = simt::launch(2, 64, 0, readable, collectives_kernel, &result); break;
    case 1: failure = simt::launch(1, 32, 0, readable, divergent_kernel); break;
    case 2: failure = simt::launch(1, 32, 0, readable, early_exit_kernel); break;
    case 3:
    case 4:
      failure = simt::launch(1, 32, 16 * 32, readable, staging_kernel,
                             static_cast<const uint8_t*>(source), which == 4, &result);
      break;
    case 5:
      failure = simt::launch(1, 32, 16, readable, stray_copy_kernel,
                             static_cast<const uint8_t*>(source + sizeof(source)));
      break;
    case 6: {
      const auto saved = simt::deadlock_timeout;
      simt::deadlock_timeout = std::chrono::milliseconds(500);
      failure = simt::launch(1, 32, 0, readable, missing_lane_kernel);
      simt::deadlock_timeout = saved;
      break;
    }
    default: failure = "unknown self-test case";
  }
  return finish(failure, result, message, message_len);
}
