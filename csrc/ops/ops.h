// SPDX-License-Identifier: Apache-2.0
//
// Declarations of every op implementation that torch_bindings.cpp registers: the CPU impls
// (codec_ops.cpp, layout_ops.cpp, lookup_ops.cpp) and, in CUDA builds, the CUDA impls
// (lookup_ops_cuda.cpp).
//
// A compressed table travels as six tensors plus four ints, in this order everywhere:
//   payload uint8 [bytes + pad], block_base int64 [blocks + 1], row_units uint8 [blocks * 32],
//   bitmask int32 [ceil(N / 32)], mask int64 [V], bitval int64 [V * K] (uint64 bit patterns;
//   the codebooks of format.h, K = 2^C - 1, so the code width C follows from the length),
//   chunk_bits, row_bytes, unit_bytes, num_rows.
// Gathers and pooled lookups also take an optional decoded tier (format.h TableView::tier_dir)
// as two trailing tensors: tier_dir int64 [ceil(N / 64) * 2] (per 64 rows a bit word and the
// tier rows before it; empty: every row) and tier_rows uint8 [tier rows, stride >= row_bytes]
// (op_checks.h check_tier_shape).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ibpembed/format.h"

namespace ibpembed {

// -- codec_ops.cpp: fitting and compression (CPU only) ----------------------------------------
std::tuple<at::Tensor, at::Tensor> ibp_fit_cpu(const at::Tensor& sample, int64_t chunk_bits,
                                               c10::string_view method, int64_t code_bits);
std::vector<at::Tensor> ibp_fit_codebooks_cpu(const at::Tensor& sample, int64_t chunk_bits,
                                              at::IntArrayRef code_bits);
at::Tensor ibp_slot_bytes_cpu(const at::Tensor& rows, int64_t chunk_bits, const at::Tensor& mask,
                              const at::Tensor& bitval, int64_t unit_bytes);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ibp_compress_cpu(
    const at::Tensor& rows, int64_t chunk_bits, const at::Tensor& mask, const at::Tensor& bitval,
    int64_t unit_bytes);

// -- layout_ops.cpp: a table's slots relaid for a GPU's zero-copy reads (CPU only) -------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> ibp_line_aware_cpu(
    const at::Tensor& payload, const at::Tensor& block_base, const at::Tensor& row_units,
    int64_t row_bytes, int64_t unit_bytes, int64_t num_rows);

// -- lookup_ops.cpp: gathers and pooled lookups on the CPU -------------------------------------
at::Tensor ibp_gather_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                          const at::Tensor& row_units, const at::Tensor& bitmask,
                          const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                          int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                          const at::Tensor& indices, const std::optional<at::Tensor>& tier_dir,
                          const std::optional<at::Tensor>& tier_rows);
at::Tensor ibp_decompress_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                              const at::Tensor& row_units, const at::Tensor& bitmask,
                              const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                              int64_t row_bytes, int64_t unit_bytes, int64_t num_rows);
at::Tensor lookup_pooled_cpu_op(const at::Tensor& payload, const at::Tensor& block_base,
                                const at::Tensor& row_units, const at::Tensor& bitmask,
                                const at::Tensor& mask, const at::Tensor& bitval,
                                int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes,
                                int64_t num_rows, const at::Tensor& indices,
                                const at::Tensor& offsets,
                                const std::optional<at::Tensor>& per_sample_weights, int64_t dtype,
                                int64_t pooling, const std::optional<at::Tensor>& tier_dir,
                                const std::optional<at::Tensor>& tier_rows);

// Tables registered once for lookup_pooled_tables, validated as they are added.
//
// NOTE(ops): a DCNv2-profile request reads 26 tables with a few ids each. One lookup_pooled
// call per table costs ~15 us of dispatch, argument boxing and re-validation of the table's
// masks and codebooks (up to V * 15 words), more than decoding a B=1 request's rows; a set
// pays that once per table version and a request makes one call.
//
// A set holds the tables of one device: CPU tables, or (CUDA builds) tables whose small tensors
// are on one GPU, validated as the CUDA ops validate them, their views pointing at device memory
// and at the payload's device alias; the CUDA impl of lookup_pooled_tables reads those.
class TableSet : public torch::CustomClassHolder {
 public:
  struct Entry {
    TableView view;
    int64_t payload_bytes;  // readable bytes at view.payload
    DType dtype;
    int64_t dim;                    // fp32 outputs per bag
    std::vector<at::Tensor> owned;  // keeps every memory the view points into alive
  };

  // Adds a table (the six tensors and four ints of lookup_pooled, its dtype code and the
  // optional decoded tier, whose directory is checked here in full); returns its position.
  int64_t add(const at::Tensor& payload, const at::Tensor& block_base, const at::Tensor& row_units,
              const at::Tensor& bitmask, const at::Tensor& mask, const at::Tensor& bitval,
              int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
              int64_t dtype, const std::optional<at::Tensor>& tier_dir,
              const std::optional<at::Tensor>& tier_rows);

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

  // The device of the set's tables (CPU while it is empty).
  c10::Device device() const { return device_; }

  // GPU sets: the entries as the kernels read them, in device memory (made as tables are added).
  const at::Tensor& device_entries() const { return device_entries_; }

  const Entry& at(int64_t position) const {
    TORCH_CHECK_INDEX(position >= 0 && position < size(), "table ", position,
                      " is not in this TableSet of ", size(), " tables");
    return entries_[static_cast<size_t>(position)];
  }

 private:
  std::vector<Entry> entries_;
  c10::Device device_{c10::kCPU};
  at::Tensor device_entries_;
};

std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_cpu(
    const c10::intrusive_ptr<TableSet>& tables, const at::Tensor& indices,
    const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling);

}  // namespace ibpembed

#ifdef IBPEMBED_WITH_CUDA
#include "../cuda/kernels.h"

// -- lookup_ops_cuda.cpp: the same lookups on a GPU (CUDA builds only) --------------------------
namespace ibpembed::gpu {
at::Tensor ibp_gather_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                           const at::Tensor& row_units, const at::Tensor& bitmask,
                           const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                           int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                           const at::Tensor& indices, const std::optional<at::Tensor>& tier_dir,
                           const std::optional<at::Tensor>& tier_rows);
at::Tensor ibp_decompress_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                               const at::Tensor& row_units, const at::Tensor& bitmask,
                               const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                               int64_t row_bytes, int64_t unit_bytes, int64_t num_rows);
at::Tensor lookup_pooled_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                              const at::Tensor& row_units, const at::Tensor& bitmask,
                              const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                              int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                              const at::Tensor& indices, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& per_sample_weights, int64_t dtype,
                              int64_t pooling, const std::optional<at::Tensor>& tier_dir,
                              const std::optional<at::Tensor>& tier_rows);

// -- host_memory_cuda.cpp: in-place registration of host buffers (Python module functions) ----
// lookup_pooled_tables on a GPU set: every table of one chunk width in one launch.
std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_cuda(
    const c10::intrusive_ptr<TableSet>& tables, const at::Tensor& indices,
    const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling);
// Deferred error reporting for the calling thread's CUDA ops (lookup_ops_cuda.cpp): off (the
// default), each op raises what its kernels found before it returns (one stream sync per op);
// on, the error is raised at the next op on the same stream, or by check_errors(), which
// synchronises the current stream.
void set_defer_errors(bool defer);
void check_errors();
// A GPU table validated as the CUDA ops validate it, as a TableSet entry.
TableSet::Entry table_set_entry(const at::Tensor& payload, const at::Tensor& block_base,
                                const at::Tensor& row_units, const at::Tensor& bitmask,
                                const at::Tensor& mask, const at::Tensor& bitval,
                                int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes,
                                int64_t num_rows, int64_t dtype,
                                const std::optional<at::Tensor>& tier_dir,
                                const std::optional<at::Tensor>& tier_rows);
// The entries as the kernels read them, copied into memory of `device`.
at::Tensor upload_entries(const std::vector<TableSet::Entry>& entries, const c10::Device& device);

// The HBM tiers of a TableSet's tables (service/ibpembed/engine/hbm_tier.py), one per position
// (or none), for lookup_pooled_tables_hbm: each tier's rank directory, slot offsets (compressed
// form only), payload, slot count and counters, checked against its table as they are added;
// upload() then copies them all, as the kernels read them (kernels.h DeviceTier), to the GPU in
// one copy and waits once. A set is read only once uploaded and takes no adds after: a lookup
// sees every tier of a publication or none. Built per tier publication; a TableSet per table
// version.
class TierSet : public torch::CustomClassHolder {
 public:
  // Adds the tier of table `size()` of `tables` (no tensors: that table has none); slot_offset
  // absent: the decoded form.
  int64_t add(const c10::intrusive_ptr<TableSet>& tables, const std::optional<at::Tensor>& dir,
              const std::optional<at::Tensor>& slot_offset,
              const std::optional<at::Tensor>& payload, int64_t num_slots,
              const std::optional<at::Tensor>& counters);
  // Copies the tiers added so far to the GPU (on the current stream) and waits for the copy.
  void upload();
  int64_t size() const { return static_cast<int64_t>(host_.size()); }
  bool uploaded() const { return device_tiers_.defined(); }
  const at::Tensor& device_tiers() const { return device_tiers_; }
  // The set whose tables these tiers were checked against (null before the first add): a
  // residency map is sized for its own table, so a lookup through another set would read past it.
  const TableSet* tables() const { return tables_.get(); }

 private:
  c10::intrusive_ptr<TableSet> tables_;
  std::vector<DeviceTier> host_;   // the tiers as the kernels read them
  std::vector<at::Tensor> owned_;  // keeps every tensor a tier points into alive
  at::Tensor device_tiers_;
};

// ibp_gather of a table read through its HBM tier: rows the residency map holds from the tier's
// payload, the others from the table's, in one launch; the kernels count hits and misses into
// tier_counters (int64 [2]). tier_slot_offset absent: the decoded form.
at::Tensor ibp_gather_hbm_cuda(const at::Tensor& payload, const at::Tensor& block_base,
                               const at::Tensor& row_units, const at::Tensor& bitmask,
                               const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                               int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                               const at::Tensor& indices, const at::Tensor& tier_dir,
                               const std::optional<at::Tensor>& tier_slot_offset,
                               const at::Tensor& tier_payload, int64_t tier_slots,
                               const at::Tensor& tier_counters);
// lookup_pooled_tables with each table read through its tier in `tiers`.
std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_hbm_cuda(
    const c10::intrusive_ptr<TableSet>& tables, const c10::intrusive_ptr<TierSet>& tiers,
    const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling);

// A CUDA uint8 tensor aliasing all of `host` (a CPU tensor over its whole storage), registered
// with cudaHostRegister (read-only where asked and the device supports it); the registration
// lasts, and keeps the host storage alive, as long as any view of the alias does.
at::Tensor host_mapped_alias(const at::Tensor& host, bool read_only, int64_t device_index);
bool host_register_read_only_supported(int64_t device_index);
}  // namespace ibpembed::gpu
#endif
