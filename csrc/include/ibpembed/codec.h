// SPDX-License-Identifier: Apache-2.0
//
// CPU codec API: fit, compress and row decode over raw pointers. Torch-free; the torch ops in
// csrc/ops/ add validation, tensors and threading (every function here works on a row range so
// callers can split the work).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ibpembed/format.h"

namespace ibpembed {

// ----------------------------------------------------------------------------------------------
// Fit: choose per-chunk-position (mask, bitval) for a chunk width from a sample of rows.

enum class FitMethod {
  // Per position, rank bits by agreement with their majority value and keep the prefix of that
  // ranking that maximises (bits kept invariant) x (sample rows matching all of them).
  kGreedy,
  // The published algorithm: one global threshold T in {0.70, 0.75, ..., 1.00} applied to every
  // (position, bit) census, T chosen by the realised net saving over the sample.
  kPaper,
};

struct ChunkMasks {
  std::vector<uint64_t> mask;    // [num_chunks], low W bits used
  std::vector<uint64_t> bitval;  // [num_chunks], bitval & ~mask == 0
};

ChunkMasks fit_masks(const uint8_t* rows, int64_t num_rows, int64_t row_bytes, int chunk_bits,
                     FitMethod method);

// ----------------------------------------------------------------------------------------------
// Row kernels of one CPU path. Chosen once at load time (see cpu_path()).

enum class CpuPath { kRef, kBmi2 };

struct RowKernels {
  // comp_bytes[r] = compressed encoding size of row r in bytes (before slot rounding).
  void (*size_rows)(const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                    const uint64_t* mask, const uint64_t* bitval, int chunk_bits,
                    int64_t* comp_bytes);
  // Writes row r at payload + offsets[r]: encoded if compressed[r], else verbatim.
  void (*encode_rows)(const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                      const uint64_t* mask, const uint64_t* bitval, int chunk_bits,
                      const uint8_t* compressed, const int64_t* offsets, uint8_t* payload);
  // Decode rows ids[0..n) of the table into out (row_bytes each, back to back). Raw rows copy.
  // ids[n..n + lookahead) are the ids the caller decodes next: only prefetched.
  // With row_ptrs, row i is at row_ptrs[i] instead: raw rows are then not copied (the pointer
  // is into the payload), compressed rows still decode into out.
  void (*decode_rows)(const TableView& table, const int64_t* ids, int64_t n, int64_t lookahead,
                      uint8_t* out, const uint8_t** row_ptrs);
};

const RowKernels& row_kernels(CpuPath path);
const RowKernels& ref_row_kernels();
const RowKernels& bmi2_row_kernels();

bool cpu_has_bmi2();
// The path in use: IBPEMBED_CPU_PATH=ref|bmi2 if set, else bmi2 where the CPU has it.
CpuPath active_cpu_path();
void set_active_cpu_path(CpuPath path);
const char* cpu_path_name(CpuPath path);

// ----------------------------------------------------------------------------------------------
// Compress, in two passes over a row range so the caller can parallelise and allocate once:
// plan_slots, a prefix sum of the slot sizes, then RowKernels::encode_rows.

// Slot size in units for each row of [0, num_rows): writes units[] and sets compressed[] flags.
void plan_slots(const RowKernels& k, const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                const uint64_t* mask, const uint64_t* bitval, int chunk_bits, int64_t unit_bytes,
                uint8_t* units, uint8_t* compressed);

}  // namespace ibpembed
