// SPDX-License-Identifier: Apache-2.0
//
// The two compress passes over a row range: size every slot, then write every slot.
#include <cstring>
#include <vector>

#include "ibpembed/codec.h"

namespace ibpembed {

void plan_slots(const RowKernels& k, const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                const uint64_t* mask, const uint64_t* bitval, int chunk_bits, int64_t unit_bytes,
                uint8_t* units, uint8_t* compressed) {
  const int64_t raw_units = units_for(row_bytes, unit_bytes);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t comp =
        k.compressed_bytes(rows + r * row_bytes, row_bytes, mask, bitval, chunk_bits);
    const int64_t comp_units = units_for(comp, unit_bytes);
    const bool shrinks = comp_units < raw_units;
    units[r] = static_cast<uint8_t>(shrinks ? comp_units : raw_units);
    compressed[r] = shrinks ? 1 : 0;
  }
}

void write_slots(const RowKernels& k, const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                 const uint64_t* mask, const uint64_t* bitval, int chunk_bits,
                 const uint8_t* compressed, const int64_t* offsets, uint8_t* payload) {
  // Encoding ORs bits into a zeroed scratch row with 9 bytes of write slack, then copies only
  // the encoded bytes: neighbouring slots (possibly written by other threads) are never touched.
  std::vector<uint8_t> scratch(static_cast<size_t>(row_bytes) + 64);
  for (int64_t r = 0; r < num_rows; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* dst = payload + offsets[r];
    if (!compressed[r]) {
      std::memcpy(dst, row, static_cast<size_t>(row_bytes));
      continue;
    }
    const int64_t bytes = k.compressed_bytes(row, row_bytes, mask, bitval, chunk_bits);
    std::memset(scratch.data(), 0, static_cast<size_t>(bytes) + 16);
    k.encode(row, row_bytes, mask, bitval, chunk_bits, scratch.data());
    std::memcpy(dst, scratch.data(), static_cast<size_t>(bytes));
  }
}

}  // namespace ibpembed
