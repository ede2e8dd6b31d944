// SPDX-License-Identifier: Apache-2.0
//
// A SIGBUS guard for the table files a server reads through memory mappings (mapping_guard.cpp).
#pragma once

#include <cstdint>

namespace ibpembed {

// Installs the process's SIGBUS handler (once; later calls do nothing).
void install_mapping_guard();

// Guards [begin, begin + bytes) (rounded out to whole pages); returns the guard's slot, or -1
// when every slot is taken (the range then stays unguarded).
int guard_mapping(uintptr_t begin, uint64_t bytes);

// Stops guarding a slot (before its memory is unmapped).
void unguard_mapping(int slot);

// Faults the guard absorbed in the guarded range holding `address` (0 when none holds it), and
// in every range since the process started.
int64_t mapping_faults_at(uintptr_t address);
int64_t mapping_faults_total();

}  // namespace ibpembed
