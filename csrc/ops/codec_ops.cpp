// SPDX-License-Identifier: Apache-2.0
//
// The CPU implementations of the codec ops: ibp_fit, ibp_fit_codebooks, ibp_slot_bytes and
// ibp_compress (schemas in torch_bindings.cpp). Fitting and compression run on the CPU only.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_op_checks.h"
#include "ibpembed/codec.h"
#include "ops.h"
#include "parallel.h"

namespace ibpembed {
namespace {

void check_rows(const at::Tensor& rows) {
  check_cpu_contiguous(rows, "rows", at::kByte);
  TORCH_CHECK_VALUE(rows.dim() == 2, "rows must be 2-D [N, row_bytes], got ", rows.dim(), "-D");
  TORCH_CHECK_VALUE(rows.size(1) > 0 && rows.size(1) <= kMaxRowBytes, "row width must be in [1, ",
                    kMaxRowBytes, "] bytes, got ", rows.size(1));
}

// A zeroed payload buffer, on huge pages (advise_huge_pages, before the first touch).
at::Tensor zeroed_payload(int64_t bytes) {
  at::Tensor payload = at::empty({bytes}, at::kByte);
  advise_huge_pages(payload);
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
      joined[i].bitval.insert(joined[i].bitval.end(), part[i].bitval.begin(), part[i].bitval.end());
    }
  }
  return joined;
}

}  // namespace

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
  const std::vector<ChunkMasks> fitted = fit_positions_in_parallel(
      sample, w,
      [&](const SampleRows& columns) { return fit_codebook_widths(columns, w, widths); });
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
  const int num_chunks = chunks_per_row(row_bytes, static_cast<int>(chunk_bits));
  const int code_bits = check_masks(mask, bitval, num_chunks, chunk_bits);
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
  TORCH_CHECK_VALUE(unit_bytes == slot_unit_bytes(row_bytes, unit_bytes), "unit_bytes ", unit_bytes,
                    " is not a valid slot unit for ", row_bytes, "-byte rows");
  const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  const auto* b = reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  const RowKernels& k = active_kernels();
  const int64_t blocks = num_blocks(n);

  at::Tensor row_units = at::zeros({blocks * kRowsPerBlock}, at::kByte);
  std::vector<uint8_t> compressed(n);
  uint8_t* units = row_units.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    plan_slots(k, src + begin * row_bytes, end - begin, row_bytes, m, b, w, code_bits, unit_bytes,
               units + begin, compressed.data() + begin);
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

}  // namespace ibpembed
