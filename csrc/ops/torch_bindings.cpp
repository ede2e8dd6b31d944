// SPDX-License-Identifier: Apache-2.0
//
// Every ibpembed op schema, and the CPU implementations. CUDA implementations of the same schemas
// register from torch_bindings_cuda.cpp, compiled only in CUDA builds, so Python code calls
// torch.ops.ibpembed.* on every build without branching.
//
// A compressed table travels as six tensors plus four ints, in this order everywhere:
//   payload uint8 [bytes + pad], block_base int64 [blocks + 1], row_units uint8 [blocks * 32],
//   bitmask int32 [ceil(N / 32)], mask int64 [V], bitval int64 [V * K] (uint64 bit patterns;
//   the codebooks of format.h, K = 2^C - 1, so the code width C follows from the length),
//   chunk_bits, row_bytes, unit_bytes, num_rows.
// Gathers and pooled lookups also take an optional hot-row overlay (format.h) as two trailing
// tensors: hot_dir int64 [ceil(N / 64) * 2] and hot_rows uint8 [cached rows, row_bytes].
//
// lookup_pooled_tables reads several tables in one call: they are registered once in a TableSet
// (torch.classes.ibpembed.TableSet), each with the same tensors and ints, then its dtype code.
#include <torch/extension.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "ibpembed/bits.h"
#include "ibpembed/codec.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"
#include "op_checks.h"
#include "parallel.h"

namespace ibpembed {
namespace {

void check_cpu_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

void check_chunk_bits(int64_t chunk_bits) {
  TORCH_CHECK_VALUE(chunk_bits == 16 || chunk_bits == 32 || chunk_bits == 64,
                    "chunk_bits must be 16, 32 or 64, got ", chunk_bits);
}

void check_rows(const at::Tensor& rows) {
  check_cpu_contiguous(rows, "rows", at::kByte);
  TORCH_CHECK_VALUE(rows.dim() == 2, "rows must be 2-D [N, row_bytes], got ", rows.dim(), "-D");
  TORCH_CHECK_VALUE(rows.size(1) > 0 && rows.size(1) <= kMaxRowBytes, "row width must be in [1, ",
                    kMaxRowBytes, "] bytes, got ", rows.size(1));
}

// Validates masks and codebooks; returns the code width C their sizes imply.
int check_masks(const at::Tensor& mask, const at::Tensor& bitval, int64_t num_chunks,
                int64_t chunk_bits) {
  check_cpu_contiguous(mask, "mask", at::kLong);
  check_cpu_contiguous(bitval, "bitval", at::kLong);
  TORCH_CHECK_VALUE(mask.dim() == 1 && mask.size(0) == num_chunks, "mask must have ", num_chunks,
                    " entries (one per chunk position), got shape ", mask.sizes());
  const int code_bits = bitval.dim() == 1
                            ? code_bits_for(bitval.size(0), static_cast<int>(num_chunks))
                            : 0;
  TORCH_CHECK_VALUE(code_bits != 0, "bitval must have ", num_chunks,
                    " * (2^C - 1) entries (a codebook per chunk position, C in [1, ",
                    kMaxCodeBits, "]), got shape ", bitval.sizes());
  const int k = codebook_size(code_bits);
  const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  const auto* b = reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>());
  const uint64_t outside = ~low_bits(static_cast<int>(chunk_bits));
  for (int64_t j = 0; j < num_chunks; ++j) {
    TORCH_CHECK_VALUE((m[j] & outside) == 0, "mask[", j, "] has bits above chunk_bits");
    for (int64_t e = j * k; e < (j + 1) * k; ++e) {
      TORCH_CHECK_VALUE((b[e] & ~m[j]) == 0, "bitval[", e, "] has bits outside mask[", j, "]");
    }
  }
  return code_bits;
}

// Validates the six table tensors against the four ints and returns the decoder's view.
TableView table_view(const at::Tensor& payload, const at::Tensor& block_base,
                     const at::Tensor& row_units, const at::Tensor& bitmask,
                     const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                     int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  check_chunk_bits(chunk_bits);
  TORCH_CHECK_VALUE(row_bytes > 0 && row_bytes <= kMaxRowBytes, "row_bytes out of range: ",
                    row_bytes);
  TORCH_CHECK_VALUE(num_rows >= 0, "num_rows must be >= 0");
  TORCH_CHECK_VALUE(unit_bytes == slot_unit_bytes(row_bytes, unit_bytes),
                    "unit_bytes ", unit_bytes, " is not a valid slot unit for ", row_bytes,
                    "-byte rows");
  check_cpu_contiguous(payload, "payload", at::kByte);
  check_cpu_contiguous(block_base, "block_base", at::kLong);
  check_cpu_contiguous(row_units, "row_units", at::kByte);
  check_cpu_contiguous(bitmask, "bitmask", at::kInt);
  const int64_t blocks = num_blocks(num_rows);
  TORCH_CHECK_VALUE(block_base.numel() == blocks + 1, "block_base must have ", blocks + 1,
                    " entries, got ", block_base.numel());
  TORCH_CHECK_VALUE(row_units.numel() == blocks * kRowsPerBlock, "row_units must have ",
                    blocks * kRowsPerBlock, " entries, got ", row_units.numel());
  TORCH_CHECK_VALUE(bitmask.numel() == (num_rows + 31) / 32, "bitmask must have ",
                    (num_rows + 31) / 32, " words, got ", bitmask.numel());
  const int v = chunks_per_row(row_bytes, static_cast<int>(chunk_bits));
  const int code_bits = check_masks(mask, bitval, v, chunk_bits);
  const int64_t* base = block_base.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(base[0] == 0 && base[blocks] + kPayloadPad <= payload.numel(),
                    "payload holds ", payload.numel(), " bytes but the index ends at ",
                    base[blocks], " (+", kPayloadPad, " pad)");
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
                   v,
                   code_bits};
}

// Attaches the optional hot-row overlay (format.h) to a table view: both tensors or neither.
// Like the index, the directory is trusted past its shape (it is built from the table by
// ibpembed.codec); the count of cached rows it implies must match hot_rows.
void attach_hot_rows(TableView& t, const std::optional<at::Tensor>& hot_dir,
                     const std::optional<at::Tensor>& hot_rows) {
  check_hot_rows_shape(hot_dir, hot_rows, t.num_rows, t.row_bytes);
  if (!hot_dir.has_value()) return;
  check_cpu_contiguous(*hot_dir, "hot_dir", at::kLong);
  check_cpu_contiguous(*hot_rows, "hot_rows", at::kByte);
  const int64_t words = (t.num_rows + 63) / 64;
  const auto* dir = reinterpret_cast<const uint64_t*>(hot_dir->data_ptr<int64_t>());
  const int64_t cached =
      words == 0 ? 0 : static_cast<int64_t>(dir[2 * words - 1]) + popcount64(dir[2 * words - 2]);
  TORCH_CHECK_VALUE(cached == hot_rows->size(0), "hot_dir lists ", cached,
                    " cached rows but hot_rows holds ", hot_rows->size(0));
  t.hot_dir = dir;
  t.hot_rows = hot_rows->data_ptr<uint8_t>();
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
    TORCH_CHECK_VALUE(o[b] <= o[b + 1], "offsets must be non-decreasing: offsets[", b, "] = ",
                      o[b], " > offsets[", b + 1, "] = ", o[b + 1]);
  }
}

// The optional per-sample weights of a pooled lookup over nnz indices, or null without them.
const float* checked_weights(const std::optional<at::Tensor>& weights, int64_t nnz) {
  if (!weights.has_value()) return nullptr;
  check_cpu_contiguous(*weights, "per_sample_weights", at::kFloat);
  check_weights_shape(*weights, nnz);
  return weights->data_ptr<float>();
}

const RowKernels& active_kernels() { return row_kernels(active_cpu_path()); }

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

// A zeroed payload buffer. NOTE(ops): lookups touch rows at random, so with 4 KiB pages almost
// every row costs a TLB miss and a page walk; transparent huge pages (asked for before the first
// touch) avoid most of them. Best effort: where THP is off the advice is ignored.
at::Tensor zeroed_payload(int64_t bytes) {
  at::Tensor payload = at::empty({bytes}, at::kByte);
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<uintptr_t>(payload.data_ptr<uint8_t>());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  std::memset(payload.data_ptr<uint8_t>(), 0, static_cast<size_t>(bytes));
  return payload;
}

SampleRows whole_rows(const at::Tensor& rows) {
  return SampleRows{rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), rows.size(1)};
}

// Runs `fit` (SampleRows -> one ChunkMasks per result) on ranges of chunk positions in parallel
// and joins the ranges. NOTE(ops): the fits treat every position on its own (codec.h
// SampleRows), so the result does not depend on the thread count.
template <class Fit>
std::vector<ChunkMasks> fit_positions_in_parallel(const at::Tensor& sample, int chunk_bits,
                                                  const Fit& fit) {
  const int64_t row_bytes = sample.size(1);
  const int64_t chunk_bytes = chunk_bits / 8;
  const int v = chunks_per_row(row_bytes, chunk_bits);
  std::vector<std::vector<ChunkMasks>> parts(static_cast<size_t>(v));  // by first position
  at::parallel_for(0, v, 1, [&](int64_t first, int64_t end) {
    const int64_t begin_byte = first * chunk_bytes;
    const SampleRows columns{sample.data_ptr<uint8_t>() + begin_byte, sample.size(0),
                             std::min(end * chunk_bytes, row_bytes) - begin_byte, row_bytes};
    parts[static_cast<size_t>(first)] = fit(columns);
  });
  std::vector<ChunkMasks> joined;
  for (const std::vector<ChunkMasks>& part : parts) {
    for (size_t i = 0; i < part.size(); ++i) {
      if (joined.size() <= i) joined.emplace_back();
      joined[i].mask.insert(joined[i].mask.end(), part[i].mask.begin(), part[i].mask.end());
      joined[i].bitval.insert(joined[i].bitval.end(), part[i].bitval.begin(),
                              part[i].bitval.end());
    }
  }
  return joined;
}

// ---------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> ibp_fit_cpu(const at::Tensor& sample, int64_t chunk_bits,
                                               c10::string_view method, int64_t code_bits) {
  check_rows(sample);
  check_chunk_bits(chunk_bits);
  TORCH_CHECK_VALUE(sample.size(0) > 0, "ibp_fit needs at least one sample row");
  TORCH_CHECK_VALUE(code_bits >= 1 && code_bits <= kMaxCodeBits, "code_bits must be in [1, ",
                    kMaxCodeBits, "], got ", code_bits);
  TORCH_CHECK_VALUE(code_bits == 1 || method == "ibpembed",
                    "code_bits > 1 (exponent-aware codebooks) needs method 'ibpembed'");
  FitMethod fit_method;
  if (method == "ibpembed") {
    fit_method = FitMethod::kGreedy;
  } else if (method == "paper") {
    fit_method = FitMethod::kPaper;
  } else {
    TORCH_CHECK_VALUE(false, "method must be 'ibpembed' or 'paper', got '", std::string(method),
                      "'");
  }
  const int w = static_cast<int>(chunk_bits);
  const int c = static_cast<int>(code_bits);
  const ChunkMasks fitted =
      fit_method == FitMethod::kPaper
          ? fit_masks(whole_rows(sample), w, fit_method, c)
          : fit_positions_in_parallel(sample, w, [&](const SampleRows& columns) {
              return std::vector<ChunkMasks>{fit_masks(columns, w, fit_method, c)};
            })[0];
  const int64_t v = static_cast<int64_t>(fitted.mask.size());
  const int64_t entries = static_cast<int64_t>(fitted.bitval.size());
  at::Tensor mask = at::empty({v}, at::kLong);
  at::Tensor bitval = at::empty({entries}, at::kLong);
  std::memcpy(mask.data_ptr<int64_t>(), fitted.mask.data(), v * 8);
  std::memcpy(bitval.data_ptr<int64_t>(), fitted.bitval.data(), entries * 8);
  return {mask, bitval};
}

std::vector<at::Tensor> ibp_fit_codebooks_cpu(const at::Tensor& sample, int64_t chunk_bits,
                                              at::IntArrayRef code_bits) {
  check_rows(sample);
  check_chunk_bits(chunk_bits);
  TORCH_CHECK_VALUE(sample.size(0) > 0, "ibp_fit_codebooks needs at least one sample row");
  std::vector<int> widths;
  for (const int64_t c : code_bits) {
    TORCH_CHECK_VALUE(c >= 2 && c <= kMaxCodeBits, "code_bits must be in [2, ", kMaxCodeBits,
                      "], got ", c);
    widths.push_back(static_cast<int>(c));
  }
  const int w = static_cast<int>(chunk_bits);
  const std::vector<ChunkMasks> fitted =
      fit_positions_in_parallel(sample, w, [&](const SampleRows& columns) {
        return fit_codebook_widths(columns, w, widths);
      });
  std::vector<at::Tensor> out;
  for (const ChunkMasks& f : fitted) {
    at::Tensor mask = at::empty({static_cast<int64_t>(f.mask.size())}, at::kLong);
    at::Tensor bitval = at::empty({static_cast<int64_t>(f.bitval.size())}, at::kLong);
    std::memcpy(mask.data_ptr<int64_t>(), f.mask.data(), f.mask.size() * 8);
    std::memcpy(bitval.data_ptr<int64_t>(), f.bitval.data(), f.bitval.size() * 8);
    out.push_back(mask);
    out.push_back(bitval);
  }
  return out;
}

at::Tensor ibp_slot_bytes_cpu(const at::Tensor& rows, int64_t chunk_bits, const at::Tensor& mask,
                              const at::Tensor& bitval, int64_t unit_bytes) {
  check_rows(rows);
  check_chunk_bits(chunk_bits);
  const int64_t row_bytes = rows.size(1);
  const int code_bits =
      check_masks(mask, bitval, chunks_per_row(row_bytes, static_cast<int>(chunk_bits)), chunk_bits);
  TORCH_CHECK_VALUE(unit_bytes >= 1 && unit_bytes <= kMaxSlotUnit,
                    "the minimum slot unit must lie in [1, ", kMaxSlotUnit, "], got ", unit_bytes);
  const int64_t unit = slot_unit_bytes(row_bytes, unit_bytes);
  const int64_t n = rows.size(0);
  std::vector<uint8_t> units(n), compressed(n);
  const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  const auto* b = reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  const RowKernels& k = active_kernels();
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    plan_slots(k, src + begin * row_bytes, end - begin, row_bytes, m, b,
               static_cast<int>(chunk_bits), code_bits, unit, units.data() + begin,
               compressed.data() + begin);
  });
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) o[r] = units[r] * unit;
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ibp_compress_cpu(
    const at::Tensor& rows, int64_t chunk_bits, const at::Tensor& mask, const at::Tensor& bitval,
    int64_t unit_bytes) {
  check_rows(rows);
  check_chunk_bits(chunk_bits);
  const int64_t n = rows.size(0);
  const int64_t row_bytes = rows.size(1);
  const int w = static_cast<int>(chunk_bits);
  const int code_bits = check_masks(mask, bitval, chunks_per_row(row_bytes, w), chunk_bits);
  TORCH_CHECK_VALUE(unit_bytes == slot_unit_bytes(row_bytes, unit_bytes), "unit_bytes ",
                    unit_bytes, " is not a valid slot unit for ", row_bytes, "-byte rows");
  const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  const auto* b = reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  const RowKernels& k = active_kernels();
  const int64_t blocks = num_blocks(n);

  at::Tensor row_units = at::zeros({blocks * kRowsPerBlock}, at::kByte);
  std::vector<uint8_t> compressed(n);
  uint8_t* units = row_units.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    plan_slots(k, src + begin * row_bytes, end - begin, row_bytes, m, b, w, code_bits,
               unit_bytes, units + begin, compressed.data() + begin);
  });

  at::Tensor block_base = at::empty({blocks + 1}, at::kLong);
  at::Tensor bitmask = at::zeros({(n + 31) / 32}, at::kInt);
  int64_t* base = block_base.data_ptr<int64_t>();
  auto* bits = reinterpret_cast<uint32_t*>(bitmask.data_ptr<int32_t>());
  std::vector<int64_t> offsets(n);
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (r % kRowsPerBlock == 0) base[r / kRowsPerBlock] = total;
    offsets[r] = total;
    total += units[r] * unit_bytes;
    if (compressed[r]) bits[r >> 5] |= 1u << (r & 31);
  }
  base[blocks] = total;

  at::Tensor payload = zeroed_payload(total + kPayloadPad);
  uint8_t* dst = payload.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    k.encode_rows(src + begin * row_bytes, end - begin, row_bytes, m, b, w, code_bits,
                  compressed.data() + begin, offsets.data() + begin, dst);
  });
  return {payload, block_base, row_units, bitmask};
}

at::Tensor ibp_gather_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                          const at::Tensor& row_units, const at::Tensor& bitmask,
                          const at::Tensor& mask, const at::Tensor& bitval, int64_t chunk_bits,
                          int64_t row_bytes, int64_t unit_bytes, int64_t num_rows,
                          const at::Tensor& indices, const std::optional<at::Tensor>& hot_dir,
                          const std::optional<at::Tensor>& hot_rows) {
  TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                           row_bytes, unit_bytes, num_rows);
  attach_hot_rows(t, hot_dir, hot_rows);
  check_indices(indices, num_rows);
  at::Tensor out = at::empty({indices.numel(), row_bytes}, at::kByte);
  read_rows([&] {
    gather_rows_cpu(active_kernels(), t, indices.data_ptr<int64_t>(), indices.numel(),
                    out.data_ptr<uint8_t>());
  });
  return out;
}

at::Tensor ibp_decompress_cpu(const at::Tensor& payload, const at::Tensor& block_base,
                              const at::Tensor& row_units, const at::Tensor& bitmask,
                              const at::Tensor& mask, const at::Tensor& bitval,
                              int64_t chunk_bits, int64_t row_bytes, int64_t unit_bytes,
                              int64_t num_rows) {
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
                                const std::optional<at::Tensor>& per_sample_weights,
                                int64_t dtype, int64_t pooling,
                                const std::optional<at::Tensor>& hot_dir,
                                const std::optional<at::Tensor>& hot_rows) {
  TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                           row_bytes, unit_bytes, num_rows);
  attach_hot_rows(t, hot_dir, hot_rows);
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

// Tables registered once for lookup_pooled_tables, validated as they are added.
//
// NOTE(ops): a DCNv2-profile request reads 26 tables with a few ids each. One lookup_pooled
// call per table costs ~15 us of dispatch, argument boxing and re-validation of the table's
// masks and codebooks (up to V * 15 words), more than decoding a B=1 request's rows; a set
// pays that once per table version and a request makes one call.
class TableSet : public torch::CustomClassHolder {
 public:
  struct Entry {
    TableView view;
    DType dtype;
    int64_t dim;                    // fp32 outputs per bag
    std::vector<at::Tensor> owned;  // keeps every memory the view points into alive
  };

  // Adds a table (the six tensors and four ints of lookup_pooled, its dtype code and the
  // optional hot-row overlay); returns its position in the set.
  int64_t add(const at::Tensor& payload, const at::Tensor& block_base,
              const at::Tensor& row_units, const at::Tensor& bitmask, const at::Tensor& mask,
              const at::Tensor& bitval, int64_t chunk_bits, int64_t row_bytes,
              int64_t unit_bytes, int64_t num_rows, int64_t dtype,
              const std::optional<at::Tensor>& hot_dir,
              const std::optional<at::Tensor>& hot_rows) {
    TableView t = table_view(payload, block_base, row_units, bitmask, mask, bitval, chunk_bits,
                             row_bytes, unit_bytes, num_rows);
    attach_hot_rows(t, hot_dir, hot_rows);
    const int64_t dim = check_pooling_args(dtype, 0, row_bytes);
    std::vector<at::Tensor> owned{payload, block_base, row_units, bitmask, mask, bitval};
    if (hot_dir.has_value()) {
      owned.push_back(*hot_dir);
      owned.push_back(*hot_rows);
    }
    entries_.push_back(Entry{t, static_cast<DType>(dtype), dim, std::move(owned)});
    return static_cast<int64_t>(entries_.size()) - 1;
  }

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

  const Entry& at(int64_t position) const {
    TORCH_CHECK_INDEX(position >= 0 && position < size(), "table ", position,
                      " is not in this TableSet of ", size(), " tables");
    return entries_[static_cast<size_t>(position)];
  }

 private:
  std::vector<Entry> entries_;
};

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
  TORCH_CHECK_VALUE(pooling == 0 || pooling == 1, "pooling must be 0 (sum) or 1 (mean), got ",
                    pooling);
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

}  // namespace

TORCH_LIBRARY(ibpembed, m) {
  m.def(
      "ibp_fit(Tensor sample, int chunk_bits, str method, int code_bits=1) -> (Tensor, Tensor)");
  // The codebook fits of several code widths at once: [mask, bitval] per width, in order.
  m.def("ibp_fit_codebooks(Tensor sample, int chunk_bits, int[] code_bits) -> Tensor[]");
  m.def(
      "ibp_slot_bytes(Tensor rows, int chunk_bits, Tensor mask, Tensor bitval, int unit_bytes) "
      "-> Tensor");
  m.def(
      "ibp_compress(Tensor rows, int chunk_bits, Tensor mask, Tensor bitval, int unit_bytes) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ibp_decompress(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows) "
      "-> Tensor");
  m.def(
      "ibp_gather(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows, "
      "Tensor indices, Tensor? hot_dir=None, Tensor? hot_rows=None) -> Tensor");
  m.def(
      "lookup_pooled(Tensor payload, Tensor block_base, Tensor row_units, Tensor bitmask, "
      "Tensor mask, Tensor bitval, int chunk_bits, int row_bytes, int unit_bytes, int num_rows, "
      "Tensor indices, Tensor offsets, Tensor? per_sample_weights, int dtype, int pooling, "
      "Tensor? hot_dir=None, Tensor? hot_rows=None) -> Tensor");
  m.class_<TableSet>("TableSet").def(torch::init<>()).def("add", &TableSet::add);
  m.def(
      "lookup_pooled_tables(__torch__.torch.classes.ibpembed.TableSet tables, Tensor indices, "
      "Tensor offsets, Tensor table_bags, Tensor? per_sample_weights, int pooling) "
      "-> (Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(ibpembed, CPU, m) {
  m.impl("ibp_fit", &ibp_fit_cpu);
  m.impl("ibp_fit_codebooks", &ibp_fit_codebooks_cpu);
  m.impl("ibp_slot_bytes", &ibp_slot_bytes_cpu);
  m.impl("ibp_compress", &ibp_compress_cpu);
  m.impl("ibp_decompress", &ibp_decompress_cpu);
  m.impl("ibp_gather", &ibp_gather_cpu);
  m.impl("lookup_pooled", &lookup_pooled_cpu_op);
  m.impl("lookup_pooled_tables", &lookup_pooled_tables_cpu);
}

}  // namespace ibpembed

// The Python module only carries process-level controls; all table work goes through torch.ops.
PYBIND11_MODULE(_C, module) {
  module.doc() = "ibpembed native ops (registered under torch.ops.ibpembed)";
  module.attr("FORMAT_VERSION") = ibpembed::kFormatVersion;
  module.def("cpu_path", [] { return std::string(ibpembed::cpu_path_name(ibpembed::active_cpu_path())); },
             "The CPU codec path in use: 'avx512', 'bmi2' or 'ref'.");
  module.def("cpu_has_bmi2", &ibpembed::cpu_has_bmi2, "Whether this CPU reports BMI2.");
  module.def("cpu_has_avx512", &ibpembed::cpu_has_avx512,
             "Whether this CPU runs the AVX-512 path (BMI2, AVX-512 F/BW/VBMI/VBMI2).");
  module.def("cpu_has_microcoded_pdep", &ibpembed::cpu_has_microcoded_pdep,
             "Whether this CPU runs pdep/pext in microcode (AMD Zen 1/2).");
  module.def(
      "default_cpu_path",
      [] { return std::string(ibpembed::cpu_path_name(ibpembed::default_cpu_path())); },
      "The path chosen when IBPEMBED_CPU_PATH is unset.");
  module.def(
      "set_cpu_path",
      [](const std::string& name) {
        ibpembed::CpuPath path;
        TORCH_CHECK_VALUE(ibpembed::cpu_path_from_name(name.c_str(), &path),
                          "cpu path must be 'ref', 'bmi2' or 'avx512', got '", name, "'");
        ibpembed::set_active_cpu_path(path);
      },
      "Switch the CPU codec path for this process (tests and benchmarks).");
}
