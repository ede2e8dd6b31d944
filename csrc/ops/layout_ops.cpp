// SPDX-License-Identifier: Apache-2.0
//
// The CPU implementation of ibp_line_aware (schema in torch_bindings.cpp): a compressed table
// relaid for a GPU's zero-copy reads, each slot moved to the next 32-byte boundary where that
// lowers the 128-byte lines it touches (service/ibpembed/tables/gpu_layout.py says why).
//
// NOTE(ops): each slot's place depends on where the one before it ended, so the placement is one
// sequential pass. In Python it was a loop over the rows (2-3.5 s per million rows, about an
// hour for a billion); here the pass and the copy take about 0.12 us a row, most of it the new
// payload's first touch (8M 256-byte rows: 1.0 s against 16 s). The copy of the slots' bytes,
// once every place is known, runs in parallel.
#include <ATen/ops/empty.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_op_checks.h"
#include "ibpembed/format.h"
#include "ops.h"
#include "parallel.h"

namespace ibpembed {
namespace {

constexpr int64_t kSector = 32;  // bytes a GPU moves per sector
constexpr int64_t kLine = 128;   // bytes a PCIe read request covers

int64_t lines_touched(int64_t offset, int64_t size) {
  return (offset % kLine + size + kLine - 1) / kLine;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> ibp_line_aware_cpu(
    const at::Tensor& payload, const at::Tensor& block_base, const at::Tensor& row_units,
    int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  check_cpu_contiguous(payload, "payload", at::kByte);
  check_cpu_contiguous(block_base, "block_base", at::kLong);
  check_cpu_contiguous(row_units, "row_units", at::kByte);
  const int64_t blocks = check_index_shapes(block_base, row_units, row_bytes, unit_bytes, num_rows);

  // A slot may grow by a gap only while it stays shorter than a raw slot (format.h): a slot of
  // max_units is a raw row, which its readers take at its length.
  const int64_t max_units = units_for(row_bytes, unit_bytes);
  const uint8_t* units = row_units.data_ptr<uint8_t>();
  const int64_t* base = block_base.data_ptr<int64_t>();
  const int64_t payload_bytes = payload.numel();
  at::Tensor new_row_units = row_units.clone();  // rows past num_rows keep their units (zero)
  uint8_t* new_units = new_row_units.data_ptr<uint8_t>();
  std::vector<int64_t> from(static_cast<size_t>(num_rows));
  std::vector<int64_t> to(static_cast<size_t>(num_rows));
  int64_t source = 0;
  int64_t cursor = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (r % kRowsPerBlock == 0) source = base[r / kRowsPerBlock];
    const int64_t size = units[r] * unit_bytes;
    // Compared as `source <= payload_bytes - size`: a corrupt base near 2^63 would wrap
    // `source + size` back into range.
    TORCH_CHECK_VALUE(source >= 0 && source <= payload_bytes - size, "row ", r,
                      "'s slot lies outside the payload (", payload_bytes, " bytes)");
    from[r] = source;
    source += size;
    const int64_t aligned = (cursor + kSector - 1) / kSector * kSector;
    const int64_t gap = aligned - cursor;
    if (r > 0 && gap > 0 && gap % unit_bytes == 0 &&
        new_units[r - 1] + gap / unit_bytes < max_units &&
        lines_touched(aligned, size) < lines_touched(cursor, size)) {
      new_units[r - 1] = static_cast<uint8_t>(new_units[r - 1] + gap / unit_bytes);
      cursor = aligned;
    }
    to[r] = cursor;
    cursor += size;
  }

  at::Tensor new_block_base = at::empty({blocks + 1}, at::kLong);
  int64_t* new_base = new_block_base.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    new_base[b] = total;
    for (int64_t i = b * kRowsPerBlock; i < (b + 1) * kRowsPerBlock; ++i) {
      total += new_units[i] * unit_bytes;
    }
  }
  new_base[blocks] = total;

  // Each slot's bytes, then zeros up to the next slot (the gap) or past the end (the pad): every
  // byte is written once. NOTE(ops): no huge-page advice (unlike a compressed payload that
  // lookups read): this payload is written to a file once, and with the kernel's default THP
  // defrag policy an advised region's first touch compacts memory, which took 1M rows from
  // 0.12 s to 1.0 s here.
  const int64_t end_bytes = cursor + kPayloadPad;
  at::Tensor new_payload = at::empty({end_bytes}, at::kByte);
  const uint8_t* src = payload.data_ptr<uint8_t>();
  uint8_t* dst = new_payload.data_ptr<uint8_t>();
  if (num_rows == 0) std::memset(dst, 0, static_cast<size_t>(end_bytes));
  at::parallel_for(0, num_rows, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t size = units[r] * unit_bytes;
      const int64_t next = r + 1 < num_rows ? to[r + 1] : end_bytes;
      std::memcpy(dst + to[r], src + from[r], static_cast<size_t>(size));
      std::memset(dst + to[r] + size, 0, static_cast<size_t>(next - to[r] - size));
    }
  });
  return {new_payload, new_block_base, new_row_units};
}

}  // namespace ibpembed
