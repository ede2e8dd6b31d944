// SPDX-License-Identifier: Apache-2.0
//
// The CPU implementations of the lookup ops: ibp_gather, ibp_decompress, lookup_pooled and
// lookup_pooled_tables over a TableSet (schemas in torch_bindings.cpp).
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

#include <chrono>
#include <string>
#include <vector>

#include "cpu_op_checks.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"
#include "ibpembed/tier.h"
#include "ops.h"

namespace ibpembed {
namespace {

// Validates the six table tensors against the four ints and returns the decoder's view.
TableView table_view(const at::Tensor& payload, const at::Tensor& block_base,
                     const at::Tensor& row_units, const at::Tensor& bitmask, const at::Tensor& mask,
                     const at::Tensor& bitval, int64_t chunk_bits, int64_t row_bytes,
                     int64_t unit_bytes, int64_t num_rows) {
  check_cpu_contiguous(payload, "payload", at::kByte);
  check_cpu_contiguous(block_base, "block_base", at::kLong);
  check_cpu_contiguous(row_units, "row_units", at::kByte);
  check_cpu_contiguous(bitmask, "bitmask", at::kInt);
  check_cpu_contiguous(mask, "mask", at::kLong);
  check_cpu_contiguous(bitval, "bitval", at::kLong);
  const TableShape shape = check_table_shapes(block_base, row_units, bitmask, mask, bitval,
                                              chunk_bits, row_bytes, unit_bytes, num_rows);
  check_masks(mask, bitval, shape.chunks, chunk_bits);
  const int64_t blocks = num_blocks(num_rows);
  const int64_t* base = block_base.data_ptr<int64_t>();
  // Compared as `end <= numel - pad`: an end near 2^63 would wrap `end + pad` back into range
  // and make every slot bound of the decoders (row_kernels_impl.h) pass.
  TORCH_CHECK_VALUE(
      base[0] == 0 && base[blocks] >= 0 && base[blocks] <= payload.numel() - kPayloadPad,
      "payload holds ", payload.numel(), " bytes but the index ends at ", base[blocks], " (+",
      kPayloadPad, " pad)");
  return TableView{payload.data_ptr<uint8_t>(),
                   base,
                   row_units.data_ptr<uint8_t>(),
                   bitmask.data_ptr<int32_t>(),
                   reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>()),
                   reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>()),
                   num_rows,
                   row_bytes,
                   unit_bytes,
                   static_cast<int>(chunk_bits),
                   shape.chunks,
                   shape.code_bits};
}

// Attaches the optional decoded tier (format.h) to a table view: both tensors or neither. The
// directory is checked here by its shape and its total only (checking every word would cost a
// B = 1 lookup of a large table more than its rows): the readers bound each slot they take
// against the tier's rows (tier.h tier_slot). TableSet::add, which runs once per table version,
// checks every word.
void attach_tier(TableView& t, const std::optional<at::Tensor>& tier_dir,
                 const std::optional<at::Tensor>& tier_rows) {
  check_tier_shape(tier_dir, tier_rows, t.num_rows, t.row_bytes);
  if (!tier_dir.has_value()) return;
  check_cpu_contiguous(*tier_dir, "tier_dir", at::kLong);
  check_cpu_contiguous(*tier_rows, "tier_rows", at::kByte);
  t.tier_rows = tier_rows->data_ptr<uint8_t>();
  t.tier_stride = tier_rows->size(1);
  t.tier_num_rows = tier_rows->size(0);
  if (tier_dir->numel() == 0) return;
  const int64_t words = tier_dir_words(t.num_rows);
  const auto* dir = reinterpret_cast<const uint64_t*>(tier_dir->data_ptr<int64_t>());
  // The last word's rows end within the tier's slots, at the held rows' count in a tier as
  // built (tier.h).
  const auto end = static_cast<int64_t>(dir[2 * words - 1]) + popcount64(dir[2 * words - 2]);
  TORCH_CHECK_VALUE(end <= tier_rows->size(0), "tier_dir's last word ends at slot ", end,
                    " but tier_rows holds ", tier_rows->size(0), " rows");
  t.tier_dir = dir;
}

// Every word of a tier directory: its rows lie within the tier's slots (where in them is the
// tier's choice: tier.h), and no bit lies past the table's last row.
void check_tier_dir(const TableView& t) {
  if (t.tier_dir == nullptr) return;
  const int64_t words = tier_dir_words(t.num_rows);
  const auto slots = static_cast<uint64_t>(t.tier_num_rows);
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t base = t.tier_dir[2 * w + 1];
    const auto count = static_cast<uint64_t>(popcount64(t.tier_dir[2 * w]));
    TORCH_CHECK_VALUE(base <= slots && count <= slots - base, "tier_dir[", 2 * w + 1, "] puts the ",
                      count, " rows of word ", w, " at slot ", static_cast<int64_t>(base),
                      ", past the tier's ", slots, " slots");
  }
  const int tail = static_cast<int>(t.num_rows - kTierWordRows * (words - 1));
  TORCH_CHECK_VALUE(tail == kTierWordRows || (t.tier_dir[2 * words - 2] >> tail) == 0,
                    "tier_dir marks rows past the table's ", t.num_rows);
}

// ids[begin, end) all in [0, num_rows); `call_table` >= 0 names, in the error, the row of
// lookup_pooled_tables' table_bags the ids are for (a number, not a string: this runs per table
// per request and the message is built only on failure).
void check_ids_in_range(const int64_t* ids, int64_t begin, int64_t end, int64_t num_rows,
                        int64_t call_table = -1) {
  // One branch-free pass; the exact culprit is searched for only on failure. An id is out of
  // range iff id or (num_rows - 1 - id), as uint64, has its top bit set: ORs and subtractions
  // that SSE2 vectorises, where an unsigned 64-bit compare (none in SSE2) kept the loop scalar
  // at ~1.5 ns per id, 8 % of a pooled lookup of cached rows (development profile).
  const auto last = static_cast<uint64_t>(num_rows - 1);
  uint64_t out_of_range = 0;
  for (int64_t i = begin; i < end; ++i) {
    const auto id = static_cast<uint64_t>(ids[i]);
    out_of_range |= id | (last - id);
  }
  if ((out_of_range >> 63) == 0) return;
  for (int64_t i = begin; i < end; ++i) {
    TORCH_CHECK_INDEX(ids[i] >= 0 && ids[i] < num_rows, "index ", ids[i], " at position ", i,
                      call_table >= 0 ? " (table_bags[" + std::to_string(call_table) + "])" : "",
                      " is out of range for a table of ", num_rows, " rows");
  }
}

void check_indices(const at::Tensor& indices, int64_t num_rows) {
  check_cpu_contiguous(indices, "indices", at::kLong);
  TORCH_CHECK_VALUE(indices.dim() == 1, "indices must be 1-D, got ", indices.dim(), "-D");
  check_ids_in_range(indices.data_ptr<int64_t>(), 0, indices.numel(), num_rows);
}

void check_offsets(const at::Tensor& offsets, int64_t nnz) {
  check_cpu_contiguous(offsets, "offsets", at::kLong);
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 1,
                    "offsets must be 1-D with B + 1 entries");
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t n = offsets.numel();
  TORCH_CHECK_VALUE(o[0] == 0, "offsets[0] must be 0, got ", o[0]);
  TORCH_CHECK_VALUE(o[n - 1] == nnz, "offsets[-1] must equal the number of indices (", nnz,
                    "), got ", o[n - 1]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    TORCH_CHECK_VALUE(o[b] <= o[b + 1], "offsets must be non-decreasing: offsets[", b, "] = ", o[b],
                      " > offsets[", b + 1, "] = ", o[b + 1]);
  }
}

// The optional per-sample weights of a pooled lookup over nnz indices, or null without them.
const float* checked_weights(const std::optional<at::Tensor>& weights, int64_t nnz) {
  if (!weights.has_value()) return nullptr;
  check_cpu_contiguous(*weights, "per_sample_weights", at::kFloat);
  check_weights_shape(*weights, nnz);
  return weights->data_ptr<float>();
}

// Runs a row-kernel call. Bytes that contradict the table's layout (codec.h CorruptTableError,
// found before anything is read past a slot) become a ValueError naming the row.
template <class Call>
void read_rows(const Call& call) {
  try {
    call();
  } catch (const CorruptTableError& e) {
    TORCH_CHECK_VALUE(false, "corrupted table: ", e.what(),
                      " (`ibpembed verify FILE` checks a table file's payload)");
  }
}

}  // namespace

at::Tensor ibp_gather_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                          const at::Tensor& row_units, const at::Tensor& bitmask,
                          const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                          int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                          const at::Tensor& indices, const std::optional<at::Tensor>& tier_dir,
                          const std::optional<at::Tensor>& tier_rows) {
  TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                           row_bytes, unit_bytes, num_rows);
  attach_tier(t, tier_dir, tier_rows);
  check_indices(indices, num_rows);
  // On huge pages: the rows may become a decoded tier, read at random (codec.with_hot_rows).
  at::Tensor out = at::empty({indices.numel(), row_bytes}, at::kByte);
  advise_huge_pages(out);
  read_rows([&] {
    gather_rows_cpu(active_kernels(), t, indices.data_ptr<int64_t>(), indices.numel(),
                    out.data_ptr<uint8_t>());
  });
  return out;
}

at::Tensor ibp_decompress_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                              const at::Tensor& row_units, const at::Tensor& bitmask,
                              const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                              int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  return ibp_gather_cpu(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                        row_bytes, unit_bytes, num_rows, at::arange(num_rows, at::kLong),
                        std::nullopt, std::nullopt);
}

at::Tensor lookup_pooled_cpu_op(const at::Tensor& payload, const at::Tensor& block_base,
                                const at::Tensor& row_units, const at::Tensor& bitmask,
                                const at::Tensor& mask, const at::Tensor& bitval,
                                int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes,
                                int64_t num_rows, const at::Tensor& indices,
                                const at::Tensor& offsets,
                                const std::optional<at::Tensor>& per_sample_weights, int64_t dtype,
                                int64_t pooling, const std::optional<at::Tensor>& tier_dir,
                                const std::optional<at::Tensor>& tier_rows) {
  TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                           row_bytes, unit_bytes, num_rows);
  attach_tier(t, tier_dir, tier_rows);
  const int64_t dim = check_pooling_args(dtype, pooling, row_bytes);
  const auto dt = static_cast<DType>(dtype);
  check_indices(indices, num_rows);
  check_offsets(offsets, indices.numel());
  const float* weights = checked_weights(per_sample_weights, indices.numel());
  const int64_t bags = offsets.numel() - 1;
  at::Tensor out = at::empty({bags, dim}, at::kFloat);
  read_rows([&] {
    lookup_pooled_cpu(active_kernels(), t, dt, indices.data_ptr<int64_t>(),
                      offsets.data_ptr<int64_t>(), bags, weights, static_cast<Pooling>(pooling),
                      out.data_ptr<float>());
  });
  return out;
}

// Pooled lookups of several tables over one CSR batch. Row k of `table_bags` (int64 [K, 3]) is
// (set position, first bag, bag count): table k of the call is that set entry and pools bags
// [first, first + count) of `offsets`, whose entries index `indices` (and `per_sample_weights`)
// as a whole. A tensor rather than int lists: Python's dispatch of ops taking a TorchScript
// object walks every list argument element by element. Every argument and every id is checked
// before any table is read. Returns each table's [count, dim] fp32 output and the seconds each
// table's lookup took (float64 [K], for the server's kernel metrics).
std::tuple<std::vector<at::Tensor>, at::Tensor> lookup_pooled_tables_cpu(
    const c10::intrusive_ptr<TableSet>& tables, const at::Tensor& indices,
    const at::Tensor& offsets, const at::Tensor& table_bags,
    const std::optional<at::Tensor>& per_sample_weights, int64_t pooling) {
  TORCH_CHECK_VALUE(tables->device().is_cpu(), "this TableSet's tables are on ", tables->device(),
                    ": pass indices and offsets on that device");
  check_pooling(pooling);
  check_cpu_contiguous(table_bags, "table_bags", at::kLong);
  TORCH_CHECK_VALUE(table_bags.dim() == 2 && table_bags.size(1) == 3,
                    "table_bags must be [K, 3] (set position, first bag, bag count), got shape ",
                    table_bags.sizes());
  check_cpu_contiguous(indices, "indices", at::kLong);
  TORCH_CHECK_VALUE(indices.dim() == 1, "indices must be 1-D, got ", indices.dim(), "-D");
  check_offsets(offsets, indices.numel());
  const float* weights = checked_weights(per_sample_weights, indices.numel());
  const auto count = static_cast<size_t>(table_bags.size(0));
  const int64_t* calls = table_bags.data_ptr<int64_t>();
  const int64_t num_bags = offsets.numel() - 1;
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* ids = indices.data_ptr<int64_t>();
  std::vector<const TableSet::Entry*> entries(count);
  for (size_t k = 0; k < count; ++k) {
    entries[k] = &tables->at(calls[3 * k]);
    const int64_t first = calls[3 * k + 1];
    const int64_t bags = calls[3 * k + 2];
    TORCH_CHECK_VALUE(first >= 0 && bags >= 0 && bags <= num_bags - first, "table_bags[", k,
                      "] reads bags [", first, ", ", first + bags, ") of a batch of ", num_bags);
    check_ids_in_range(ids, o[first], o[first + bags], entries[k]->view.num_rows,
                       static_cast<int64_t>(k));
  }
  const RowKernels& kernels = active_kernels();
  std::vector<at::Tensor> out(count);
  at::Tensor seconds = at::empty({static_cast<int64_t>(count)}, at::kDouble);
  double* elapsed = seconds.data_ptr<double>();
  for (size_t k = 0; k < count; ++k) {
    const auto start = std::chrono::steady_clock::now();
    const TableSet::Entry& e = *entries[k];
    const int64_t first = calls[3 * k + 1];
    const int64_t bags = calls[3 * k + 2];
    out[k] = at::empty({bags, e.dim}, at::kFloat);
    read_rows([&] {
      lookup_pooled_cpu(kernels, e.view, e.dtype, ids, o + first, bags, weights,
                        static_cast<Pooling>(pooling), out[k].data_ptr<float>());
    });
    elapsed[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return {std::move(out), seconds};
}

int64_t TableSet::add(const at::Tensor& payload, const at::Tensor& block_base,
                      const at::Tensor& row_units, const at::Tensor& bitmask,
                      const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                      int64_t row_bytes, int64_t unit_bytes, int64_t num_rows, int64_t dtype,
                      const std::optional<at::Tensor>& tier_dir,
                      const std::optional<at::Tensor>& tier_rows) {
  const c10::Device device = block_base.device();
  TORCH_CHECK_VALUE(entries_.empty() || device == device_,
                    "a TableSet holds tables of one "
                    "device: this one's are on ",
                    device_, ", the new table's on ", device);
  if (device.is_cuda()) {
#ifdef IBPEMBED_WITH_CUDA
    entries_.push_back(gpu::table_set_entry(payload, block_base, row_units, bitmask, mask, bitval,
                                            chunk_bits, row_bytes, unit_bytes, num_rows, dtype,
                                            tier_dir, tier_rows));
    device_ = device;
    device_entries_ = gpu::upload_entries(entries_, device);
    return static_cast<int64_t>(entries_.size()) - 1;
#else
    TORCH_CHECK_VALUE(false, "this ibpembed build has no CUDA kernels; block_base is on ", device);
#endif
  }
  TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                           row_bytes, unit_bytes, num_rows);
  attach_tier(t, tier_dir, tier_rows);
  check_tier_dir(t);
  const int64_t dim = check_pooling_args(dtype, 0, row_bytes);
  std::vector<at::Tensor> owned{payload, block_base, row_units, bitmask, mask, bitval};
  if (tier_dir.has_value()) {
    owned.push_back(*tier_dir);
    owned.push_back(*tier_rows);
  }
  entries_.push_back(Entry{t, payload.numel(), static_cast<DType>(dtype), dim, std::move(owned)});
  return static_cast<int64_t>(entries_.size()) - 1;
}

}  // namespace ibpembed
