// SPDX-License-Identifier: Apache-2.0
//
// Finding a row in a table's decoded tier (format.h TableView::tier_dir): CPU lookups only.
#pragma once

#include <cstdint>

#include "ibpembed/bits.h"
#include "ibpembed/format.h"

namespace ibpembed {

// Row r's tier row, or -1 when the tier does not hold it (t.tier_rows set).
IBP_HD int64_t tier_slot(const TableView& t, int64_t r) {
  if (t.tier_dir == nullptr) return r;
  const uint64_t* entry = t.tier_dir + 2 * (r >> 6);
  const uint64_t bit = uint64_t{1} << (r & 63);
  if ((entry[0] & bit) == 0) return -1;
  return static_cast<int64_t>(entry[1]) + popcount64(entry[0] & (bit - 1));
}

// Row r's tier copy, or null when the table has no tier or the tier does not hold it.
IBP_HD const uint8_t* tier_row(const TableView& t, int64_t r) {
  if (t.tier_rows == nullptr) return nullptr;
  const int64_t slot = tier_slot(t, r);
  return slot < 0 ? nullptr : t.tier_rows + slot * t.tier_stride;
}

}  // namespace ibpembed
