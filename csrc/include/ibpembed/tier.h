// SPDX-License-Identifier: Apache-2.0
//
// The rank directory that finds a row in a tier of some of a table's rows, and the CPU lookups'
// decoded tier read through it (format.h TableView::tier_dir). The GPU's HBM tier
// (csrc/cuda/kernels.h DeviceTier) uses the same directory, so its layout is stated here once.
#pragma once

#include <cstdint>

#include "ibpembed/bits.h"
#include "ibpembed/format.h"

namespace ibpembed {

// Table rows per bit word of a rank directory: one uint64 (rank_slot's `r >> 6` and `r & 63`).
inline constexpr int kTierWordRows = 64;

// Bit words of the rank directory of a table of num_rows rows; the directory holds two entries
// per word (the bits, then the count before them).
IBP_HD int64_t tier_dir_words(int64_t num_rows) {
  return (num_rows + kTierWordRows - 1) / kTierWordRows;
}

// Where row r is in a tier, by the tier's rank directory `dir`: two uint64 words per 64 rows of
// the table (16 bytes, 0.25 per row), a bit word (bit r & 63 set: the tier holds row r) and the
// slot of the word's first held row. A word's held rows sit at consecutive slots in row order,
// so a held row's slot is that base plus the held rows below it in its word. In a tier as built,
// the base counts the rows the words before it hold; a new version of the tier (a row update, a
// refresh) copies the rows of each word it changes to slots past those and points the word
// there, so the versions before it keep reading theirs
// (service/ibpembed/tables/tier_versions.py).
struct RankSlot {
  bool held;
  uint64_t base;  // the word's base
  uint64_t slot;  // when held: base + the held rows below r in its word
};

// A reader that has not checked the directory in full checks base and slot against its slot
// count (base first: a corrupt base near 2^64 wraps the sum back into range).
IBP_HD RankSlot rank_slot(const uint64_t* dir, int64_t r) {
  const uint64_t* entry = dir + 2 * (r >> 6);
  const uint64_t bit = uint64_t{1} << (r & 63);
  const uint64_t below = static_cast<uint64_t>(popcount64(entry[0] & (bit - 1)));
  return RankSlot{(entry[0] & bit) != 0, entry[1], entry[1] + below};
}

// What tier_slot() returns for a row the tier does not hold, and for a held row whose slot the
// directory puts outside the tier (a corrupt directory).
inline constexpr int64_t kNotInTier = -1;
inline constexpr int64_t kBadTierSlot = -2;
constexpr const char* kBadTierSlotWhat = "the tier directory gives it a slot outside the tier";

// Row r's tier row (t.tier_rows set), kNotInTier or kBadTierSlot. The CPU ops check the
// directory per call only by its shape and its total (lookup_ops.cpp attach_tier), so each
// slot is bounded here: one branch per held row that a sound directory never takes, where
// checking every word per call would cost a small lookup of a large table more than its rows.
IBP_HD int64_t tier_slot(const TableView& t, int64_t r) {
  if (t.tier_dir == nullptr) return r;
  const RankSlot s = rank_slot(t.tier_dir, r);
  if (!s.held) return kNotInTier;
  const auto rows = static_cast<uint64_t>(t.tier_num_rows);
  return s.base < rows && s.slot < rows ? static_cast<int64_t>(s.slot) : kBadTierSlot;
}

}  // namespace ibpembed
