// SPDX-License-Identifier: Apache-2.0
//
// Registers host memory in place for the zero-copy kernels and wraps its device alias once as a
// CUDA tensor (as fbgemm's new_host_mapped_tensor does), so that no payload is copied into a new
// pinned block and no lookup queries pointers. Compiled only in CUDA builds; exposed to Python as
// ibpembed._C.host_mapped_alias (torch_bindings.cpp), which service/ibpembed/tables/placement.py
// calls once per host buffer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops.h"

namespace ibpembed::gpu {
namespace {

// What the alias's deleter needs: the registered range, its device, and the host storage kept
// alive under it.
struct Registration {
  c10::Storage host;
  void* begin;
  int device;
};

void unregister(void* context) {
  auto* registration = static_cast<Registration*>(context);
  // cudaHostUnregister is not documented to wait for kernels still reading the range (a caller
  // that drops a table while its lookups run, errors deferred): wait for the device first. It
  // runs once per table version. Nothing can be done about a failure at this point (the context
  // may be going down); the storage is released either way.
  int current = -1;
  (void)cudaGetDevice(&current);
  if (cudaSetDevice(registration->device) == cudaSuccess) (void)cudaDeviceSynchronize();
  if (current >= 0) (void)cudaSetDevice(current);
  (void)cudaHostUnregister(registration->begin);
  (void)cudaGetLastError();
  delete registration;
}

// Throws with the runtime's message after clearing the error, so that later calls do not see it.
void check_runtime(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  TORCH_CHECK(false, what, " failed: ", cudaGetErrorString(err));
}

}  // namespace

at::Tensor host_mapped_alias(const at::Tensor& host, bool read_only, int64_t device_index) {
  TORCH_CHECK_VALUE(
      host.is_cpu() && host.scalar_type() == at::kByte && host.dim() == 1 && host.is_contiguous(),
      "host_mapped_alias registers a contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK_VALUE(host.numel() > 0, "host_mapped_alias needs a non-empty buffer");
  // Whole storages only: a registration covers a range exactly once, and views of the buffer
  // are then views of its one alias (placement.py slices it).
  TORCH_CHECK_VALUE(
      host.storage_offset() == 0 && static_cast<size_t>(host.numel()) == host.storage().nbytes(),
      "host_mapped_alias takes a tensor over its whole storage (", host.storage().nbytes(),
      " bytes), got ", host.numel(), " bytes at offset ", host.storage_offset());
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  int can_map = 0;
  int read_only_supported = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory,
                                        static_cast<int>(device_index)));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&read_only_supported,
                                        cudaDevAttrHostRegisterReadOnlySupported,
                                        static_cast<int>(device_index)));
  TORCH_CHECK(can_map != 0, "GPU ", device_index, " cannot map host memory (zero-copy reads)");
  // Mapped: the kernels read it through a device alias; portable: every context sees it pinned.
  // Read-only where the device allows it: the kernels never write a payload, and registering a
  // private file mapping (the table files are mapped copy-on-write) for writing would make the
  // kernel copy every page, doubling host memory; read-only pins the page-cache pages as they are.
  unsigned int flags = cudaHostRegisterMapped | cudaHostRegisterPortable;
  if (read_only && read_only_supported != 0) flags |= cudaHostRegisterReadOnly;
  auto* begin = static_cast<uint8_t*>(host.data_ptr());
  const auto bytes = static_cast<size_t>(host.numel());
  check_runtime(cudaHostRegister(begin, bytes, flags), "cudaHostRegister");
  void* first = nullptr;
  void* last = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&first, begin, 0);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(&last, begin + bytes - 1, 0);
  // The whole range must map to one contiguous device range: the kernels trust numel().
  if (err == cudaSuccess && static_cast<uint8_t*>(last) - static_cast<uint8_t*>(first) !=
                                static_cast<std::ptrdiff_t>(bytes - 1)) {
    err = cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) {
    (void)cudaHostUnregister(begin);
    check_runtime(err, "mapping the registered range to one device range");
  }
  auto* registration = new Registration{host.storage(), begin, static_cast<int>(device_index)};
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  return at::for_blob(first, {host.numel()})
      .context(registration, &unregister)
      .options(at::TensorOptions().dtype(at::kByte).device(device))
      .target_device(device)
      .make_tensor();
}

bool host_register_read_only_supported(int64_t device_index) {
  int supported = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported,
                                        static_cast<int>(device_index)));
  return supported != 0;
}

}  // namespace ibpembed::gpu
