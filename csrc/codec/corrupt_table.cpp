// SPDX-License-Identifier: Apache-2.0
//
// CorruptTableError's out-of-line members (see codec.h): its vtable and typeinfo live here only.
#include <string>

#include "ibpembed/codec.h"

namespace ibpembed {

CorruptTableError::CorruptTableError(const std::string& what) : std::runtime_error(what) {}

CorruptTableError::~CorruptTableError() = default;

void throw_corrupt_table(int64_t row, const char* what) {
  throw CorruptTableError("row " + std::to_string(row) + ": " + what);
}

}  // namespace ibpembed
