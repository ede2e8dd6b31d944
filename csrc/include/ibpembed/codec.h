// SPDX-License-Identifier: Apache-2.0
//
// CPU codec API: fit, compress and row decode over raw pointers. Torch-free; the torch ops in
// csrc/ops/ add validation, tensors and threading (every function here works on a row range so
// callers can split the work).
#pragma once

#include <cstdint>
#include <stdexcept>
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
  std::vector<uint64_t> bitval;  // [num_chunks * K] codebooks, each entry & ~mask == 0
};

// Rows of the sample the codebook fit (code_bits > 1) reads, and the most mask bits it keeps per
// position: pattern counts stay cheap and the masks cover a float's exponent.
inline constexpr int64_t kCodebookFitRows = 65536;
// Rows of those that rank the bits (a greedy over bits, costlier per row than the counts).
inline constexpr int64_t kCodebookRankRows = 4096;
// Up to this many rows the fit counts patterns by sorting keys, above it with a histogram.
inline constexpr int64_t kSortedKeyRows = 8192;
inline constexpr int kMaxCodebookMaskBits = 16;

// The rows a fit reads: num_rows rows of `width` bytes, `stride` bytes apart. A column slice of
// the sample (data advanced by whole chunks, width cut to whole chunks or to the row's end) fits
// those chunk positions alone, with the very masks the whole row gets: kGreedy and the codebook
// fit treat every position on its own, so callers split the positions across threads. kPaper
// chooses one threshold for the whole row and needs whole rows.
struct SampleRows {
  const uint8_t* data;
  int64_t num_rows;
  int64_t width;
  int64_t stride;

  const uint8_t* row(int64_t r) const { return data + r * stride; }
};

// Masks and codebooks (bitval, V * (2^code_bits - 1) entries). code_bits > 1 fits codebooks
// (format.h's exponent-aware mode) and ignores `method`; code_bits == 1 fits with `method`.
ChunkMasks fit_masks(const SampleRows& sample, int chunk_bits, FitMethod method, int code_bits);

// The codebook fit for several code widths (each in [2, kMaxCodeBits]) at once, one result per
// entry: identical to fit_masks per width, but the bit ranking and pattern counts of a position
// (most of the cost) are shared.
std::vector<ChunkMasks> fit_codebook_widths(const SampleRows& sample, int chunk_bits,
                                            const std::vector<int>& code_bits);

// ----------------------------------------------------------------------------------------------
// Row kernels of one CPU path. Chosen once at load time (see cpu_path()).

enum class CpuPath { kRef, kBmi2, kAvx512 };

// Rows decode_rows stages per round. NOTE(codec): a round's rows are handed to a fused consumer
// (pooled lookups) while they are still in L1, and the slot lines of the next round are
// prefetched meanwhile, one row at a time, so the consumer rarely waits on DRAM.
inline constexpr int64_t kDecodeStageRows = 32;

// Decoded copies of the rows one decode_rows call has decoded, so that an id looked up again in
// the same call is read, not decoded again: Zipf batches repeat 55-70 % of their ids
// (benchmarks/data.py's batches: 44 % distinct on 8.4M rows, 30 % on 100k). Direct-mapped on
// the row id and owned by the caller (one per thread). Only pooled calls (with a RowSink) use
// one: a gather writes every row to its own output row anyway, and the engine deduplicates
// gather ids before it decodes.
//
// NOTE(codec): decode_rows locates a row one round (kDecodeStageRows rows) before it decodes it,
// and hands a round's rows to the sink only after the whole round is decoded. So a slot may be
// given to another row only if no row of the new row's round reads it yet: a slot's `round` is
// the last round that took or read it, and a row whose slot is busy in its own round decodes
// into the round's scratch instead.
//
// NOTE(codec): a taken slot costs its row a decode into L2 instead of the round's L1 scratch, and
// the cache is only worth that while rows come back, which they do not where hot-row copies
// already serve the repeated rows (453 re-reads for 84,010 slots taken on 1 GiB of Zipf
// traffic) or ids do not repeat. So a call stops using it once kRepeatProbeTakes slots have
// been taken and fewer than one in kRepeatMinReuse of them was read again.
inline constexpr int64_t kRepeatProbeTakes = 256;
inline constexpr int64_t kRepeatMinReuse = 8;

struct RepeatCache {
  // What a slot holds; both fields are read and written together, so they share a line.
  struct Slot {
    int64_t row;    // row id it holds (or will hold once its round decodes it); -1: none
    int64_t round;  // last round that took or read it; -1: none
  };

  uint8_t* rows;  // [1 << slot_bits, row_bytes]
  Slot* slots;    // [1 << slot_bits]
  int slot_bits;  // >= 1
  int64_t row_bytes;

  // Fibonacci hashing: consecutive ids spread over the slots.
  size_t slot(int64_t row) const {
    return static_cast<size_t>((static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >>
                               (64 - slot_bits));
  }
  uint8_t* row_of(size_t slot) const { return rows + static_cast<int64_t>(slot) * row_bytes; }
  // Whether a call that has re-read `hits` rows from `takes` taken slots should go on using it.
  static bool pays(int64_t hits, int64_t takes) {
    return takes < kRepeatProbeTakes || hits * kRepeatMinReuse >= takes;
  }
};

// Consumer of decoded rows: called once per round, in id order, with rows[k] = row first + k of
// the decode_rows call (k < count). Raw rows point into the payload; decoded rows are only valid
// until the call returns. `repeats`, when set, spares repeated ids their decode.
struct RowSink {
  void (*consume)(void* ctx, int64_t first, int64_t count, const uint8_t* const* rows);
  void* ctx;
  RepeatCache* repeats = nullptr;
};

// Thrown by the row kernels when a table's bytes contradict its layout: a slot the index puts
// outside the payload or sizes against its compressed bit, or a compressed row whose codes ask
// for more bits than its slot holds. Such bytes come only from corruption the load-time checks
// cannot see (the payload checksum is verified on request); decoders stop at them instead of
// reading past the slot. Defined in corrupt_table.cpp, compiled without ISA flags, so the ISA
// translation units emit none of its (weak) class machinery.
class CorruptTableError : public std::runtime_error {
 public:
  explicit CorruptTableError(const std::string& what);
  ~CorruptTableError() override;
};

// Throws CorruptTableError for row `row` of a table.
[[noreturn]] void throw_corrupt_table(int64_t row, const char* what);

struct RowKernels {
  // comp_bytes[r] = compressed encoding size of row r in bytes (before slot rounding).
  void (*size_rows)(const uint8_t* rows, int64_t num_rows, int64_t row_bytes, const uint64_t* mask,
                    const uint64_t* bitval, int chunk_bits, int code_bits, int64_t* comp_bytes);
  // Writes row r at payload + offsets[r]: encoded if compressed[r], else verbatim.
  void (*encode_rows)(const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                      const uint64_t* mask, const uint64_t* bitval, int chunk_bits, int code_bits,
                      const uint8_t* compressed, const int64_t* offsets, uint8_t* payload);
  // Decode rows ids[0..n) of the table, in order. Without a sink, row i lands at
  // out + i * row_bytes (raw rows are copied). With a sink, row i is handed to it as soon as it
  // is ready instead, a round at a time: raw rows as pointers into the payload (never copied),
  // compressed rows decoded into out, which then only needs kDecodeStageRows rows and is reused.
  void (*decode_rows)(const TableView& table, const int64_t* ids, int64_t n, uint8_t* out,
                      const RowSink* sink);
};

const RowKernels& row_kernels(CpuPath path);
const RowKernels& ref_row_kernels();
const RowKernels& bmi2_row_kernels();
const RowKernels& avx512_row_kernels();

bool cpu_has_bmi2();
// AMD Zen 1/2: BMI2 is there, but pdep/pext run in microcode (slower than the ref path).
bool cpu_has_microcoded_pdep();
// BMI2 and the AVX-512 subsets the vector decoder uses (F, BW, VBMI, VBMI2), with OS support.
bool cpu_has_avx512();
bool cpu_supports(CpuPath path);
// The fastest path the CPU runs: avx512, else bmi2 unless pdep is microcoded, else ref.
CpuPath default_cpu_path();
// The path in use: IBPEMBED_CPU_PATH=ref|bmi2|avx512 if set, else default_cpu_path().
CpuPath active_cpu_path();
void set_active_cpu_path(CpuPath path);
const char* cpu_path_name(CpuPath path);
// The path named `name` ("ref", "bmi2", "avx512"); false if there is none.
bool cpu_path_from_name(const char* name, CpuPath* path);

// How the avx512 path's codebook decoder finds each chunk's pattern (row_kernels_avx512.cpp):
// one gather of whole patterns per 16 chunks, or byte tables through shuffles. Both decode the
// same bits; which is faster depends on the core, not on the ISA.
enum class PatternLookup { kGather, kByteTables };
// gather on Intel CPUs, byte tables elsewhere (gathers are slow on AMD Zen 4) and on Intel cores
// whose Gather Data Sampling mitigation is in microcode (which slows every gather).
PatternLookup default_pattern_lookup();
// IBPEMBED_PATTERN_LOOKUP=gather|tables if set, else default_pattern_lookup().
PatternLookup active_pattern_lookup();
void set_active_pattern_lookup(PatternLookup lookup);
const char* pattern_lookup_name(PatternLookup lookup);
// The lookup named `name` ("gather", "tables"); false if there is none.
bool pattern_lookup_from_name(const char* name, PatternLookup* lookup);

// Tables whose payload is larger than this many bytes read their rows through decode_rows' stage,
// without prefetches, except runs of consecutive ids (row_kernels_impl.h's NOTE): larger than the
// last-level cache, a table's rows come mostly from DRAM. default_stage_min_bytes() is the
// last-level cache's size (32 MiB where the OS does not say); IBPEMBED_STAGE_MIN_BYTES overrides.
int64_t default_stage_min_bytes();
int64_t stage_min_bytes();
void set_stage_min_bytes(int64_t bytes);
// Tables that fit the last-level cache alone but not together read from DRAM too: a process
// serving more payload bytes than the cache in all stages every table larger than the L2 cache
// (2 MiB where the OS does not say), otherwise only those larger than the cache. Does nothing
// when IBPEMBED_STAGE_MIN_BYTES is set.
void set_served_payload_bytes(int64_t bytes);

// ----------------------------------------------------------------------------------------------
// Compress, in two passes over a row range so the caller can parallelise and allocate once:
// plan_slots, a prefix sum of the slot sizes, then RowKernels::encode_rows.

// Slot size in units for each row of [0, num_rows): writes units[] and sets compressed[] flags.
void plan_slots(const RowKernels& k, const uint8_t* rows, int64_t num_rows, int64_t row_bytes,
                const uint64_t* mask, const uint64_t* bitval, int chunk_bits, int code_bits,
                int64_t unit_bytes, uint8_t* units, uint8_t* compressed);

}  // namespace ibpembed
