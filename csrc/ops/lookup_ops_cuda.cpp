// SPDX-License-Identifier: Apache-2.0
//
// CUDA implementations of ibp_gather, ibp_decompress and lookup_pooled (declared in ops.h,
// registered in torch_bindings.cpp). Compiled only in CUDA builds; host code only, the kernels are
// in csrc/cuda/.
//
// Argument contract. The dispatcher runs these whenever any tensor argument is a CUDA tensor (CUDA
// outranks CPU in dispatch-key order), which is what lets the payload stay on the host:
//   payload      uint8, contiguous, 16-byte aligned, either
//                  - pinned host memory: a CPU tensor from pin_memory() (what the table store
//                    and the torchrec module make today: a copy into page-locked memory), or one
//                    whose storage lies in a cudaHostRegister'ed range (registering the mapped
//                    file in place, without the copy, is a follow-up); the kernels read it
//                    zero-copy over PCIe through the alias cudaHostGetDevicePointer returns; or
//                  - a CUDA tensor on the op's device (tables that fit in GPU memory).
//                Pageable CPU memory is rejected: the GPU cannot read it.
//   block_base, row_units, bitmask, mask, bitval: CUDA tensors on one device, the op's device.
//                bitval is the codebook, V * (2^C - 1) entries; its length gives the code width C.
//   indices / offsets (int64), per_sample_weights (float32): CUDA tensors on that device.
//   tier_dir / tier_rows: the CPU lookups' decoded tier (format.h TableView::tier_dir); shapes
//                checked as on the CPU, not read. It holds exact copies of rows the kernels
//                decode from the payload, so results are the same.
//   Results are new CUDA tensors on that device, produced on its current stream.
// Shapes, dtypes and devices are checked here, before any launch. Values (ids in range, offsets
// well formed, index and masks consistent with the payload) are checked by the kernels as they go
// (kernels.h); each op then synchronises its stream once to read the kernels' error word and
// raises the same exception types as the CPU op (IndexError, ValueError). That one sync is the
// price of never clamping a bad id; a response is copied back to the host right after anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "../cuda/kernels.h"
#include "../cuda/warp_decode.cuh"
#include "ibpembed/format.h"
#include "ibpembed/numeric.h"
#include "ibpembed/tier.h"
#include "op_checks.h"
#include "ops.h"

namespace ibpembed::gpu {
namespace {

constexpr DeviceTier kNoTier{nullptr, nullptr, nullptr, 0, 0, nullptr};

void check_device_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                         const c10::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device,
                    " (the device of the table's small tensors), got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// The pointer the kernels read the payload through.
const uint8_t* payload_device_pointer(const at::Tensor& payload, const c10::Device& device) {
  TORCH_CHECK_VALUE(
      payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous(),
      "payload must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK_VALUE(payload.numel() >= kPayloadPad, "payload must carry its ", kPayloadPad,
                    " pad bytes");
  const auto* host = payload.data_ptr<uint8_t>();
  // The kernels stage 16-byte-aligned windows of the payload.
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(host) % 16 == 0,
                    "payload must be 16-byte aligned (do not slice it)");
  if (payload.is_cuda()) {
    TORCH_CHECK_VALUE(payload.device() == device, "a CUDA payload must be on ", device, ", got ",
                      payload.device());
    return host;
  }
  TORCH_CHECK_VALUE(payload.is_cpu(), "payload must be a pinned CPU tensor or a CUDA tensor, got ",
                    payload.device());
  // Both ends of the range are checked: a tensor that starts inside a registered range and runs
  // past it would pass a first-byte check, and the kernels' first read past the range is a GPU
  // MMU fault that kills the process's CUDA context. One registration maps a range to one
  // contiguous device range, so two ends with consistent aliases cover every byte between.
  // Tables the store serves carry a CUDA alias instead (host_mapped_alias), checked once.
  const auto* last = host + (payload.numel() - 1);
  void* alias = nullptr;
  void* last_alias = nullptr;
  for (const uint8_t* p : {host, last}) {
    cudaPointerAttributes attributes{};
    C10_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
    TORCH_CHECK_VALUE(attributes.type == cudaMemoryTypeHost, "payload byte ", p - host, " of ",
                      payload.numel(),
                      " is pageable host memory; the GPU reads the payload zero-copy, so all of "
                      "it must be pinned: payload.pin_memory() or cudaHostRegister over its "
                      "whole storage");
  }
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&alias, const_cast<uint8_t*>(host), 0));
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&last_alias, const_cast<uint8_t*>(last), 0));
  TORCH_CHECK_VALUE(
      static_cast<uint8_t*>(last_alias) - static_cast<uint8_t*>(alias) == payload.numel() - 1,
      "the payload spans more than one pinned range; pin or register it whole");
  return static_cast<const uint8_t*>(alias);
}

// Shape/dtype/device checks of the table arguments; returns the view the kernels decode.
DeviceTable device_table(const at::Tensor& payload, const at::Tensor& block_base,
                         const at::Tensor& row_units, const at::Tensor& bitmask,
                         const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                         int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  const c10::Device device = block_base.device();
  TORCH_CHECK_VALUE(device.is_cuda(),
                    "the CUDA ops need the table's block_base, row_units, bitmask, mask and "
                    "bitval on the GPU; block_base is on ",
                    device);
  check_device_tensor(block_base, "block_base", at::kLong, device);
  check_device_tensor(row_units, "row_units", at::kByte, device);
  check_device_tensor(bitmask, "bitmask", at::kInt, device);
  check_device_tensor(mask, "mask", at::kLong, device);
  check_device_tensor(bitval, "bitval", at::kLong, device);
  const TableShape shape = check_table_shapes(block_base, row_units, bitmask, mask, bitval,
                                              chunk_bits, row_bytes, unit_bytes, num_rows);
  const uint8_t* data = payload_device_pointer(payload, device);
  return DeviceTable{
      TableView{data, block_base.data_ptr<int64_t>(), row_units.data_ptr<uint8_t>(),
                bitmask.data_ptr<int32_t>(),
                reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>()),
                reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>()), num_rows, row_bytes,
                unit_bytes, static_cast<int>(chunk_bits), shape.chunks, shape.code_bits},
      payload.numel()};
}

// Gathers of fewer ids than this skip the sort (IBPEMBED_CUDA_SORT_MIN_IDS, default 4096).
// NOTE(cuda): a sort buys row locality only when ids are dense in the table and duplicates
// decoded once; uniform ids over a large table share no lines when sorted, and the server
// already sends distinct ids, so below a few thousand ids the sort (tens of microseconds of
// fixed cost) is overhead. gpu_check times ibp_none both ways (ibp_none_nosort,
// ibp_none_sorted) at every batch size: that measurement, not this default, decides the rule.
int64_t sort_min_ids() {
  const char* value = std::getenv("IBPEMBED_CUDA_SORT_MIN_IDS");
  if (value == nullptr || *value == '\0') return 4096;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(end != nullptr && *end == '\0' && parsed >= 0,
                    "IBPEMBED_CUDA_SORT_MIN_IDS must be a non-negative integer, got '", value, "'");
  return parsed;
}

// (sorted ids, their positions): a radix sort over the bits a row id of the table has
// (sort.cu), or torch's full sort for batches past CUB's int item count.
std::pair<at::Tensor, at::Tensor> sort_by_row(const at::Tensor& indices, int64_t num_rows) {
  const int64_t n = indices.numel();
  if (n > std::numeric_limits<int32_t>::max()) {
    auto [sorted, perm] = at::sort(indices);
    return {sorted, perm};
  }
  const int bits = num_rows > 1 ? 64 - __builtin_clzll(static_cast<uint64_t>(num_rows - 1)) : 1;
  at::Tensor sorted = at::empty_like(indices);
  at::Tensor perm = at::empty_like(indices);
  const at::Tensor positions = at::arange(n, indices.options());
  const size_t temp_bytes = sort_ids_temp_bytes(n, bits);
  at::Tensor temp = at::empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))},
                              indices.options().dtype(at::kByte));
  sort_ids(indices.data_ptr<int64_t>(), sorted.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
           perm.data_ptr<int64_t>(), n, bits, temp.data_ptr(), temp_bytes,
           c10::cuda::getCurrentCUDAStream(indices.device().index()).stream());
  return {sorted, perm};
}

void check_indices_tensor(const at::Tensor& indices, const c10::Device& device) {
  check_device_tensor(indices, "indices", at::kLong, device);
  TORCH_CHECK_VALUE(indices.dim() == 1, "indices must be 1-D, got ", indices.dim(), "-D");
}

// The CPU op's exception for what the kernels reported in `bits` about one call, when the call's
// arguments show it (an id out of range, bad offsets); returns when they do not. The slow search
// for the exact culprit runs only on failure.
using Diagnose = std::function<void(int32_t bits)>;

void find_culprit(int32_t bits, const at::Tensor& indices, const at::Tensor& offsets,
                  int64_t num_rows) {
  if ((bits & kErrIndex) != 0 && indices.defined()) {
    const at::Tensor ids = indices.cpu();
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < num_rows, "index ", p[i], " at position ", i,
                        " is out of range for a table of ", num_rows, " rows");
    }
  }
  if ((bits & kErrOffsets) != 0 && offsets.defined()) {
    const at::Tensor o = offsets.cpu();
    const int64_t* p = o.data_ptr<int64_t>();
    const int64_t n = o.numel();
    const int64_t nnz = indices.defined() ? indices.numel() : 0;
    TORCH_CHECK_VALUE(p[0] == 0, "offsets[0] must be 0, got ", p[0]);
    TORCH_CHECK_VALUE(p[n - 1] == nnz, "offsets[-1] must equal the number of indices (", nnz,
                      "), got ", p[n - 1]);
    for (int64_t b = 0; b + 1 < n; ++b) {
      TORCH_CHECK_VALUE(p[b] <= p[b + 1], "offsets must be non-decreasing: offsets[", b,
                        "] = ", p[b], " > offsets[", b + 1, "] = ", p[b + 1]);
    }
  }
}

[[noreturn]] void raise_table_error(int32_t bits) {
  TORCH_CHECK_VALUE(false,
                    "the compressed table is inconsistent (block_base, row_units or slot "
                    "sizes point outside the payload, mask has bits outside the chunk width, or a "
                    "bitval codebook entry has bits outside its position's mask): kernel error "
                    "bits ",
                    bits);
}

// Error reporting, synchronous (the default) or deferred (per thread: set_defer_errors).
//
// Synchronous: each call ORs into a fresh error word and reads it back once, a stream sync per
// call. Deferred: the calls of a stream OR into that stream's persistent error word, and each
// call only queues an asynchronous copy of it into page-locked host memory; what a call found
// is raised at the next deferred call on the stream that sees the copy set, or at
// check_errors(), the sync point (the engine calls it once per response, after copying the
// results back, which synchronised the stream anyway). Each call's arguments are kept until then
// so that the exception names the culprit as the CPU op does.
thread_local bool t_defer_errors = false;

struct StreamErrors {
  at::Tensor device_word;         // int32 [1], ORed into by the kernels
  int32_t* host_word;             // its copy after the last deferred call (page-locked)
  std::vector<Diagnose> pending;  // the calls since the last check
};

// Calls a stream keeps for diagnosis; past this the oldest are dropped (the error is still
// raised, with a generic message when its call was dropped).
constexpr size_t kMaxPendingCalls = 1024;

std::mutex& errors_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Per (device, stream id); entries live for the process (a worker's stream lives as long).
StreamErrors& stream_errors(const c10::cuda::CUDAStream& stream) {
  static std::map<std::pair<int, int64_t>, std::unique_ptr<StreamErrors>> errors;
  const std::lock_guard<std::mutex> lock(errors_mutex());
  auto& slot = errors[{stream.device_index(), stream.id()}];
  if (slot == nullptr) {
    auto e = std::make_unique<StreamErrors>();
    e->device_word = at::zeros({1}, at::TensorOptions(stream.device()).dtype(at::kInt));
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(int32_t), cudaHostAllocPortable));
    e->host_word = static_cast<int32_t*>(host);
    *e->host_word = 0;
    slot = std::move(e);
  }
  return *slot;
}

// Raises what the stream's copied-back error word says, if anything (and clears it).
void raise_deferred(StreamErrors& e, const c10::cuda::CUDAStream& stream) {
  if (*static_cast<volatile int32_t*>(e.host_word) == 0) return;
  // Let every queued copy land first, so none sets the word again after it is cleared.
  C10_CUDA_CHECK(cudaStreamSynchronize(stream.stream()));
  const int32_t bits = *static_cast<volatile int32_t*>(e.host_word);
  std::vector<Diagnose> pending;
  {
    const std::lock_guard<std::mutex> lock(errors_mutex());
    pending.swap(e.pending);
    *e.host_word = 0;
  }
  C10_CUDA_CHECK(cudaMemsetAsync(e.device_word.data_ptr(), 0, sizeof(int32_t), stream.stream()));
  for (const Diagnose& diagnose : pending) diagnose(bits);
  raise_table_error(bits);
}

// Where a call's kernels report errors.
struct ErrorWord {
  at::Tensor word;  // the call's own word (synchronous), or the stream's (deferred)
  StreamErrors* deferred;
  int32_t* get() { return word.data_ptr<int32_t>(); }
};

ErrorWord error_word(const c10::Device& device) {
  if (!t_defer_errors) return {at::zeros({1}, at::TensorOptions(device).dtype(at::kInt)), nullptr};
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  StreamErrors& e = stream_errors(stream);
  raise_deferred(e, stream);  // an earlier call's error, already copied back
  return {e.device_word, &e};
}

// After a call's launches: reads the word and raises (synchronous), or queues its copy-back
// and keeps `diagnose` (deferred).
void report(ErrorWord& w, const c10::Device& device, Diagnose diagnose) {
  if (w.deferred == nullptr) {
    const int32_t bits = w.word.item<int32_t>();
    if (bits == 0) return;
    diagnose(bits);
    raise_table_error(bits);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(cudaMemcpyAsync(w.deferred->host_word, w.word.data_ptr(), sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream));
  const std::lock_guard<std::mutex> lock(errors_mutex());
  auto& pending = w.deferred->pending;
  if (pending.size() == kMaxPendingCalls) pending.erase(pending.begin());
  pending.push_back(std::move(diagnose));
}

at::Tensor gather(const DeviceTable& table, const DeviceTier& tier, const at::Tensor& ids,
                  const at::Tensor& perm, int64_t n, const at::Tensor* request_ids,
                  const c10::Device& device) {
  at::Tensor out = at::empty({n, table.view.row_bytes}, at::TensorOptions(device).dtype(at::kByte));
  if (n == 0) return out;
  ErrorWord error = error_word(device);
  const GatherArgs args{table,
                        tier,
                        ids.defined() ? ids.data_ptr<int64_t>() : nullptr,
                        perm.defined() ? perm.data_ptr<int64_t>() : nullptr,
                        n,
                        out.data_ptr<uint8_t>(),
                        error.get()};
  launch_gather(args, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  const at::Tensor request = request_ids != nullptr ? *request_ids : at::Tensor();
  const int64_t rows = table.view.num_rows;
  report(error, device,
         [request, rows](int32_t bits) { find_culprit(bits, request, at::Tensor(), rows); });
  return out;
}

// The batch arguments of a pooled lookup: ids, offsets and weights on `device`; returns the
// weights' pointer (null without them).
const float* check_batch(const at::Tensor& indices, const at::Tensor& offsets,
                         const std::optional<at::Tensor>& per_sample_weights,
                         const c10::Device& device) {
  check_indices_tensor(indices, device);
  check_device_tensor(offsets, "offsets", at::kLong, device);
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 1,
                    "offsets must be 1-D with B + 1 entries");
  if (!per_sample_weights.has_value()) return nullptr;
  check_device_tensor(*per_sample_weights, "per_sample_weights", at::kFloat, device);
  check_weights_shape(*per_sample_weights, indices.numel());
  return per_sample_weights->data_ptr<float>();
}

// PooledArgs with the batch filled in and no parts yet.
PooledArgs batch_args(const at::Tensor& indices, const at::Tensor& offsets, const float* weights,
                      int64_t pooling, int32_t* error) {
  PooledArgs args{};
  args.ids = indices.data_ptr<int64_t>();
  args.offsets = offsets.data_ptr<int64_t>();
  args.num_offset_bags = offsets.numel() - 1;
  args.nnz = indices.numel();
  args.weights = weights;
  args.pooling = static_cast<Pooling>(pooling);
  args.error = error;
  return args;
}

// Widens a launch's shared-memory shape to hold a table's rows.
void grow_shape(PooledShape& shape, const TableView& t, int64_t dim) {
  shape.stage_bytes = std::max(shape.stage_bytes, stage_buffer_bytes(t.row_bytes, t.unit_bytes));
  shape.rowbuf_bytes = std::max(shape.rowbuf_bytes, rowbuf_bytes(t));
  shape.dim = std::max(shape.dim, dim);
}

// The CPU op's exceptions for a failed lookup_pooled_tables: the first id out of its table's
// range (naming the row of table_bags), bad offsets, or an inconsistent table.
void find_table_set_culprit(int32_t bits, const TableSet& tables, const at::Tensor& indices,
                            const at::Tensor& offsets, const at::Tensor& table_bags) {
  // In the CPU op's order: offsets, then each table's ids.
  if ((bits & kErrOffsets) != 0) find_culprit(kErrOffsets, indices, offsets, 0);
  if ((bits & kErrIndex) != 0) {
    const at::Tensor ids = indices.cpu();
    const at::Tensor o = offsets.cpu();
    const int64_t* p = ids.data_ptr<int64_t>();
    const int64_t* ob = o.data_ptr<int64_t>();
    const int64_t* calls = table_bags.data_ptr<int64_t>();
    for (int64_t k = 0; k < table_bags.size(0); ++k) {
      const int64_t rows = tables.at(calls[3 * k]).view.num_rows;
      const int64_t first = calls[3 * k + 1];
      for (int64_t i = ob[first]; i < ob[first + calls[3 * k + 2]]; ++i) {
        TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < rows, "index ", p[i], " at position ", i,
                          " (table_bags[", k, "]) is out of range for a table of ", rows, " rows");
      }
    }
  }
}

}  // namespace

at::Tensor ibp_gather_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                           const at::Tensor& row_units, const at::Tensor& bitmask,
                           const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                           int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                           const at::Tensor& indices, const std::optional<at::Tensor>& tier_dir,
                           const std::optional<at::Tensor>& tier_rows) {
  const c10::cuda::CUDAGuard guard(block_base.device());
  const DeviceTable table = device_table(payload, block_base, row_units, bitmask, mask, bitval,
                                         chunk_bits, row_bytes, unit_bytes, num_rows);
  check_tier_shape(tier_dir, tier_rows, num_rows, row_bytes);  // checked, then not read
  check_indices_tensor(indices, block_base.device());
  if (indices.numel() < sort_min_ids()) {
    // Unsorted ids are correct too: runs form only on adjacent equal ids, and no perm means
    // position i's row goes to output row i.
    return gather(table, kNoTier, indices, at::Tensor(), indices.numel(), &indices,
                  block_base.device());
  }
  // Sorted ids let neighbouring warps fetch neighbouring rows and put duplicates side by side;
  // perm sends each row back to its request position.
  auto [sorted, perm] = sort_by_row(indices, num_rows);
  return gather(table, kNoTier, sorted, perm, indices.numel(), &indices, block_base.device());
}

at::Tensor ibp_decompress_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                               const at::Tensor& row_units, const at::Tensor& bitmask,
                               const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                               int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  const c10::cuda::CUDAGuard guard(block_base.device());
  const DeviceTable table = device_table(payload, block_base, row_units, bitmask, mask, bitval,
                                         chunk_bits, row_bytes, unit_bytes, num_rows);
  // Undefined ids and perm: row i goes to output row i, with no index tensor at all.
  return gather(table, kNoTier, at::Tensor(), at::Tensor(), num_rows, nullptr, block_base.device());
}

at::Tensor lookup_pooled_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                              const at::Tensor& row_units, const at::Tensor& bitmask,
                              const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                              int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                              const at::Tensor& indices, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& per_sample_weights, int64_t dtype,
                              int64_t pooling, const std::optional<at::Tensor>& tier_dir,
                              const std::optional<at::Tensor>& tier_rows) {
  const c10::Device device = block_base.device();
  const c10::cuda::CUDAGuard guard(device);
  const DeviceTable table = device_table(payload, block_base, row_units, bitmask, mask, bitval,
                                         chunk_bits, row_bytes, unit_bytes, num_rows);
  check_tier_shape(tier_dir, tier_rows, num_rows, row_bytes);  // checked, then not read
  const int64_t dim = check_pooling_args(dtype, pooling, row_bytes);
  const float* weights = check_batch(indices, offsets, per_sample_weights, device);
  const int64_t bags = offsets.numel() - 1;
  at::Tensor out = at::empty({bags, dim}, at::TensorOptions(device).dtype(at::kFloat));
  if (bags == 0) {
    // No bag for a kernel to check offsets[0] == nnz with: check it here (a one-element read).
    const int64_t only = offsets.item<int64_t>();
    TORCH_CHECK_VALUE(only == 0 && indices.numel() == 0,
                      "offsets[0] must be 0 and equal the "
                      "number of indices (",
                      indices.numel(), "), got ", only);
    return out;
  }
  ErrorWord error = error_word(device);
  // One part over the whole batch, its table passed by value.
  PooledArgs args = batch_args(indices, offsets, weights, pooling, error.get());
  args.single = PooledTable{table, static_cast<DType>(dtype), dim};
  args.num_parts = 1;
  args.part_table[0] = 0;
  args.first_bag[0] = 0;
  args.bag_start[0] = 0;
  args.bag_start[1] = bags;
  args.out[0] = out.data_ptr<float>();
  args.max_dim = dim;
  PooledShape shape{0, 0, 0};
  grow_shape(shape, table.view, dim);
  launch_pooled(args, static_cast<int>(chunk_bits), shape,
                c10::cuda::getCurrentCUDAStream(device.index()).stream());
  report(error, device, [indices, offsets, num_rows](int32_t bits) {
    find_culprit(bits, indices, offsets, num_rows);
  });
  return out;
}

TableSet::Entry table_set_entry(const at::Tensor& payload, const at::Tensor& block_base,
                                const at::Tensor& row_units, const at::Tensor& bitmask,
                                const at::Tensor& mask, const at::Tensor& bitval,
                                int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes,
                                int64_t num_rows, int64_t dtype,
                                const std::optional<at::Tensor>& tier_dir,
                                const std::optional<at::Tensor>& tier_rows) {
  const c10::cuda::CUDAGuard guard(block_base.device());
  const DeviceTable table = device_table(payload, block_base, row_units, bitmask, mask, bitval,
                                         chunk_bits, row_bytes, unit_bytes, num_rows);
  check_tier_shape(tier_dir, tier_rows, num_rows, row_bytes);  // checked, then not read
  const int64_t dim = check_pooling_args(dtype, 0, row_bytes);
  // The payload's alias stays valid as long as the payload (its storage) lives: kept here.
  return TableSet::Entry{table.view,
                         table.payload_bytes,
                         static_cast<DType>(dtype),
                         dim,
                         {payload, block_base, row_units, bitmask, mask, bitval}};
}

at::Tensor upload_entries(const std::vector<TableSet::Entry>& entries, const c10::Device& device) {
  std::vector<PooledTable> host;
  host.reserve(entries.size());
  for (const TableSet::Entry& e : entries) {
    host.push_back(PooledTable{DeviceTable{e.view, e.payload_bytes}, e.dtype, e.dim});
  }
  const auto bytes = static_cast<int64_t>(host.size() * sizeof(PooledTable));
  at::Tensor out = at::empty({bytes}, at::TensorOptions(device).dtype(at::kByte));
  // Once per table set (a table version), never per request. A blocking cudaMemcpy from pageable
  // memory may return before the bytes land and runs on the legacy stream, which the engine's
  // non-blocking worker streams do not wait for: a kernel could read half-written tables. So the
  // copy goes on this device's current stream (the launches' stream), and the stream is waited
  // for, which also keeps `host` alive until the copy has read it; any other stream then sees
  // the bytes already in place.
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), host.data(), static_cast<size_t>(bytes),
                                 cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

namespace {

// lookup_pooled_tables on a GPU set, each table read through its HBM tier in `tiers` (a device
// array parallel to the set, or nullptr: none).
std::tuple<std::vector<at::Tensor>, at::Tensor> pooled_tables(
    const c10::intrusive_ptr<TableSet>& tables, const DeviceTier* tiers, const at::Tensor& indices,
    const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling) {
  const auto start = std::chrono::steady_clock::now();
  const c10::Device device = tables->device();
  TORCH_CHECK_VALUE(device.is_cuda() || tables->size() == 0,
                    "lookup_pooled_tables on a GPU needs a TableSet of GPU tables; this one's "
                    "are on ",
                    device);
  check_pooling(pooling);
  TORCH_CHECK_VALUE(table_bags.is_cpu() && table_bags.scalar_type() == at::kLong &&
                        table_bags.is_contiguous() && table_bags.dim() == 2 &&
                        table_bags.size(1) == 3,
                    "table_bags must be a contiguous int64 CPU tensor [K, 3] (set position, first "
                    "bag, bag count), got ",
                    table_bags.scalar_type(), " ", table_bags.sizes(), " on ", table_bags.device());
  const c10::Device batch_device = indices.device();
  const c10::cuda::CUDAGuard guard(batch_device);
  TORCH_CHECK_VALUE(tables->size() == 0 || batch_device == device, "indices must be on ", device,
                    " (the device of the set's tables), got ", batch_device);
  const float* weights = check_batch(indices, offsets, per_sample_weights, batch_device);
  const int64_t num_bags = offsets.numel() - 1;
  const auto count = static_cast<size_t>(table_bags.size(0));
  const int64_t* calls = table_bags.data_ptr<int64_t>();
  std::vector<at::Tensor> out(count);
  for (size_t k = 0; k < count; ++k) {
    const TableSet::Entry& e = tables->at(calls[3 * k]);
    const int64_t first = calls[3 * k + 1];
    const int64_t bags = calls[3 * k + 2];
    TORCH_CHECK_VALUE(first >= 0 && bags >= 0 && bags <= num_bags - first, "table_bags[", k,
                      "] reads bags [", first, ", ", first + bags, ") of a batch of ", num_bags);
    out[k] = at::empty({bags, e.dim}, at::TensorOptions(batch_device).dtype(at::kFloat));
  }
  if (num_bags == 0) {
    const int64_t only = offsets.item<int64_t>();
    TORCH_CHECK_VALUE(only == 0 && indices.numel() == 0,
                      "offsets[0] must be 0 and equal the "
                      "number of indices (",
                      indices.numel(), "), got ", only);
  }
  ErrorWord error = error_word(batch_device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(batch_device.index()).stream();
  const auto* device_entries =
      tables->size() == 0
          ? nullptr
          : reinterpret_cast<const PooledTable*>(tables->device_entries().data_ptr());
  // One launch per chunk width among the call's tables (a kernel decodes one width), each
  // holding up to kMaxPooledParts parts.
  for (const int width : {16, 32, 64}) {
    PooledArgs args = batch_args(indices, offsets, weights, pooling, error.get());
    args.tables = device_entries;
    args.tiers = tiers;
    PooledShape shape{0, 0, 0};
    auto flush = [&] {
      if (args.num_parts == 0) return;
      args.max_dim = shape.dim;
      launch_pooled(args, width, shape, stream);
      args.num_parts = 0;
      shape = PooledShape{0, 0, 0};
    };
    args.num_parts = 0;
    for (size_t k = 0; k < count; ++k) {
      const int64_t position = calls[3 * k];
      const TableSet::Entry& e = tables->at(position);
      if (e.view.chunk_bits != width) continue;
      const int p = args.num_parts;
      args.part_table[p] = static_cast<int32_t>(position);
      args.first_bag[p] = calls[3 * k + 1];
      args.bag_start[p + 1] = args.bag_start[p] + calls[3 * k + 2];
      args.out[p] = out[k].data_ptr<float>();
      grow_shape(shape, e.view, e.dim);
      if (++args.num_parts == kMaxPooledParts) flush();
    }
    flush();
  }
  report(error, batch_device, [tables, indices, offsets, table_bags](int32_t bits) {
    find_table_set_culprit(bits, *tables, indices, offsets, table_bags);
  });
  // Per-table seconds for the server's kernel metrics: one launch serves every table, so the
  // call's time is apportioned by each table's share of the bags (known on the host; the ids'
  // share would need the offsets back from the GPU, a sync).
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  at::Tensor seconds = at::empty({static_cast<int64_t>(count)}, at::kDouble);
  double* elapsed = seconds.data_ptr<double>();
  int64_t all_bags = 0;
  for (size_t k = 0; k < count; ++k) all_bags += calls[3 * k + 2];
  for (size_t k = 0; k < count; ++k) {
    elapsed[k] = all_bags == 0 ? total / static_cast<double>(count)
                               : total * static_cast<double>(calls[3 * k + 2]) /
                                     static_cast<double>(all_bags);
  }
  return {std::move(out), seconds};
}

// A tier's tensors checked against a table of `num_rows` rows of `row_bytes` on `device`: the
// kernels then read the directory and the slot offsets in bounds. What the directory says is
// checked by the kernels as they read it (a slot past num_slots is kErrTable, never followed),
// and so is every slot's window against the payload: reading the whole directory here would
// cost a device-to-host copy of 0.25 bytes per table row at every call.
DeviceTier device_tier(const at::Tensor& dir, const std::optional<at::Tensor>& slot_offset,
                       const at::Tensor& payload, int64_t num_slots, const at::Tensor& counters,
                       int64_t num_rows, int64_t row_bytes, const c10::Device& device) {
  check_device_tensor(dir, "tier directory", at::kLong, device);
  check_device_tensor(payload, "tier payload", at::kByte, device);
  check_device_tensor(counters, "tier counters", at::kLong, device);
  const int64_t words = tier_dir_words(num_rows);
  TORCH_CHECK_VALUE(dir.dim() == 1 && dir.numel() == 2 * words,
                    "the tier directory must hold two int64 words per 64 rows of the table (",
                    2 * words, " for ", num_rows, " rows), got ", dir.sizes());
  TORCH_CHECK_VALUE(num_slots >= 0 && num_slots <= num_rows, "a tier of a table of ", num_rows,
                    " rows holds 0 to ", num_rows, " slots, got ", num_slots);
  TORCH_CHECK_VALUE(payload.dim() == 1 && payload.numel() >= kPayloadPad &&
                        reinterpret_cast<uintptr_t>(payload.data_ptr()) % 16 == 0,
                    "tier payload must be 1-D, 16-byte aligned, with its ", kPayloadPad,
                    " pad bytes");
  const int64_t* offsets = nullptr;
  if (slot_offset.has_value()) {  // compressed form
    check_device_tensor(*slot_offset, "tier slot_offset", at::kLong, device);
    TORCH_CHECK_VALUE(slot_offset->dim() == 1 && slot_offset->numel() == num_slots + 1,
                      "tier slot_offset must be 1-D with slots + 1 (", num_slots + 1,
                      ") entries, got ", slot_offset->sizes());
    offsets = slot_offset->data_ptr<int64_t>();
  } else {  // decoded form: slot s at s * round16(row_bytes)
    const int64_t stride = round16(row_bytes);
    TORCH_CHECK_VALUE((payload.numel() - kPayloadPad) / stride >= num_slots, "a decoded tier of ",
                      num_slots, " slots of ", stride, " bytes needs a payload of ", num_slots,
                      " * ", stride, " + ", kPayloadPad, " bytes, got ", payload.numel());
  }
  TORCH_CHECK_VALUE(counters.dim() == 1 && counters.numel() == 2,
                    "tier counters must be int64 [2] (hits, misses), got ", counters.sizes());
  return DeviceTier{reinterpret_cast<const uint64_t*>(dir.data_ptr<int64_t>()),
                    offsets,
                    payload.data_ptr<uint8_t>(),
                    payload.numel(),
                    num_slots,
                    reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>())};
}

}  // namespace

std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_cuda(
    const c10::intrusive_ptr<TableSet>& tables, const at::Tensor& indices,
    const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling) {
  return pooled_tables(tables, nullptr, indices, offsets, table_bags, per_sample_weights, pooling);
}

at::Tensor ibp_gather_hbm_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                               const at::Tensor& row_units, const at::Tensor& bitmask,
                               const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                               int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                               const at::Tensor& indices, const at::Tensor& tier_dir,
                               const std::optional<at::Tensor>& tier_slot_offset,
                               const at::Tensor& tier_payload, int64_t tier_slots,
                               const at::Tensor& tier_counters) {
  const c10::Device device = block_base.device();
  const c10::cuda::CUDAGuard guard(device);
  DeviceTable table = device_table(payload, block_base, row_units, bitmask, mask, bitval,
                                   chunk_bits, row_bytes, unit_bytes, num_rows);
  const DeviceTier tier = device_tier(tier_dir, tier_slot_offset, tier_payload, tier_slots,
                                      tier_counters, num_rows, row_bytes, device);
  check_indices_tensor(indices, device);
  if (indices.numel() < sort_min_ids()) {
    return gather(table, tier, indices, at::Tensor(), indices.numel(), &indices, device);
  }
  auto [sorted, perm] = sort_by_row(indices, num_rows);
  return gather(table, tier, sorted, perm, indices.numel(), &indices, device);
}

int64_t TierSet::add(const c10::intrusive_ptr<TableSet>& tables,
                     const std::optional<at::Tensor>& dir,
                     const std::optional<at::Tensor>& slot_offset,
                     const std::optional<at::Tensor>& payload, int64_t num_slots,
                     const std::optional<at::Tensor>& counters) {
  TORCH_CHECK_VALUE(!uploaded(),
                    "a TierSet takes no tiers once uploaded (a publication is "
                    "read whole or not at all): build a new one");
  TORCH_CHECK_VALUE(!tables_ || tables_.get() == tables.get(),
                    "a TierSet's tiers all belong to the TableSet of its first add");
  const int64_t position = size();
  const TableSet::Entry& e = tables->at(position);  // the set's table of the same position
  const c10::Device device = tables->device();
  TORCH_CHECK_VALUE(device.is_cuda(),
                    "a TierSet is for a TableSet of GPU tables; this one's are "
                    "on ",
                    device);
  tables_ = tables;
  DeviceTier tier = kNoTier;
  if (dir.has_value()) {
    TORCH_CHECK_VALUE(payload.has_value() && counters.has_value(),
                      "a tier needs its directory, payload and counters together");
    tier = device_tier(*dir, slot_offset, *payload, num_slots, *counters, e.view.num_rows,
                       e.view.row_bytes, device);
    owned_.insert(owned_.end(), {*dir, *payload, *counters});
    if (slot_offset.has_value()) owned_.push_back(*slot_offset);
  } else {
    TORCH_CHECK_VALUE(!slot_offset.has_value() && !payload.has_value() && !counters.has_value(),
                      "a table without a tier takes no tier tensors");
  }
  host_.push_back(tier);
  return position;
}

void TierSet::upload() {
  TORCH_CHECK_VALUE(!uploaded(), "this TierSet is uploaded already");
  TORCH_CHECK_VALUE(tables_, "a TierSet needs its tiers (or none) added before upload()");
  const c10::Device device = tables_->device();
  const auto bytes = static_cast<int64_t>(host_.size() * sizeof(DeviceTier));
  at::Tensor out = at::empty({bytes}, at::TensorOptions(device).dtype(at::kByte));
  // As upload_entries: on the current stream, waited for, so every stream sees it in place. The
  // copy reads host_ until the wait, and nothing changes host_ after it (add() refuses then).
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), host_.data(), static_cast<size_t>(bytes),
                                 cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  device_tiers_ = out;
}

std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_hbm_cuda(
    const c10::intrusive_ptr<TableSet>& tables, const c10::intrusive_ptr<TierSet>& tiers,
    const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling) {
  TORCH_CHECK_VALUE(tiers->size() == tables->size(),
                    "a TierSet has one tier (or none) per "
                    "table of its TableSet: ",
                    tiers->size(), " for ", tables->size(), " tables");
  TORCH_CHECK_VALUE(tiers->size() == 0 || tiers->tables() == tables.get(),
                    "this TierSet was built for another TableSet (its residency maps are sized "
                    "for that set's tables)");
  TORCH_CHECK_VALUE(tiers->size() == 0 || tiers->uploaded(),
                    "a TierSet is read only after upload(): its tiers are not on the GPU yet");
  const auto* device_tiers =
      tiers->size() == 0 ? nullptr
                         : reinterpret_cast<const DeviceTier*>(tiers->device_tiers().data_ptr());
  return pooled_tables(tables, device_tiers, indices, offsets, table_bags, per_sample_weights,
                       pooling);
}

void set_defer_errors(bool defer) { t_defer_errors = defer; }

void check_errors() {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaStreamSynchronize(stream.stream()));  // the copy-back has landed
  raise_deferred(stream_errors(stream), stream);
}

}  // namespace ibpembed::gpu
