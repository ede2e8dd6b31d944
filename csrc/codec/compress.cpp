// SPDX-License-Identifier: Apache-2.0
//
// Compress pass 1 over a row range: the slot of every row (pass 2 is RowKernels::encode_rows).
#include <vector>

#include "ibpembed/codec.h"

namespace ibpembed {

void plan_slots(const RowKernels& k, const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                const uint64_t* mask, const uint64_t* bitval, int chunk_bits, int code_bits,
                int64_t unit_bytes, uint8_t* units, uint8_t* compressed) {
  const int64_t raw_units = units_for(row_bytes, unit_bytes);
  std::vector<int64_t> comp_bytes(static_cast<size_t>(num_rows));
  k.size_rows(rows, num_rows, row_bytes, mask, bitval, chunk_bits, code_bits, comp_bytes.data());
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t comp_units = units_for(comp_bytes[r], unit_bytes);
    const bool shrinks = comp_units < raw_units;
    units[r] = static_cast<uint8_t>(shrinks ? comp_units : raw_units);
    compressed[r] = shrinks ? 1 : 0;
  }
}

}  // namespace ibpembed
