// SPDX-License-Identifier: Apache-2.0
//
// The CPU lookup engine timed against an fbgemm-style control loop in one process, without torch
// (built and run by benchmarks/cpu_engine.py; benchmark-only, never part of ibpembed._C).
//
//   engine_harness DIR ROUNDS REPS BAGS_PER_CALL
//
// DIR holds two tables of the same fp32 [N, 128] rows in ibpembed's layout, raw/ and compressed/
// (each array as a little-endian .bin file, plus meta.txt), and one lookup stream (ids.bin,
// offsets.bin: int64, offsets absolute). Each round times, best of REPS passes over the stream:
// the control (fbgemm's EmbeddingSpMDM shape: eight prefetcht0 per row 16 ids ahead, 16 AVX2 adds
// per row, accumulators in registers), then lookup_pooled_cpu on the raw table, read as ibpembed
// reads an all-raw table (its payload a tier of every row, on the lean path), and on the
// compressed one, BAGS_PER_CALL bags per call. The tables' payloads ask for transparent huge
// pages, as ibpembed's do. Prints one JSON object per round (ns per lookup) and exits 1 if the
// three disagree on any pooled sum's bits (they add the same values in the same order).
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ibpembed/codec.h"
#include "ibpembed/lookup.h"

namespace {

using ibpembed::TableView;

constexpr int64_t kDim = 128;
constexpr int64_t kRowBytes = kDim * 4;
constexpr int kVecs = kDim / 8;
constexpr int64_t kHugePage = int64_t{1} << 21;
constexpr int64_t kControlPrefetchDistance = 16;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "engine_harness: %s\n", what.c_str());
  std::exit(2);
}

// A file's bytes in a fresh 2 MiB-aligned buffer (zero-padded to whole huge pages, so readers may
// run past the end like they may past a payload's padding), optionally advised to huge pages.
struct Buffer {
  uint8_t* data = nullptr;
  int64_t size = 0;
};

Buffer read_file(const std::string& path, bool huge_pages) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail("cannot open " + path);
  Buffer b;
  b.size = static_cast<int64_t>(in.tellg());
  const int64_t capacity = (b.size + kHugePage) / kHugePage * kHugePage;
  b.data = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, capacity));
  if (b.data == nullptr) fail("out of memory reading " + path);
  if (huge_pages) madvise(b.data, capacity, MADV_HUGEPAGE);
  std::memset(b.data, 0, capacity);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(b.data), b.size);
  if (!in) fail("short read of " + path);
  return b;
}

std::vector<int64_t> read_int64s(const std::string& path) {
  const Buffer b = read_file(path, false);
  std::vector<int64_t> values(b.size / 8);
  std::memcpy(values.data(), b.data, values.size() * 8);
  std::free(b.data);
  return values;
}

TableView read_table(const std::string& dir) {
  std::ifstream meta(dir + "/meta.txt");
  int64_t rows = 0, row_bytes = 0, unit_bytes = 0;
  int chunk_bits = 0, num_chunks = 0, code_bits = 0;
  if (!(meta >> rows >> row_bytes >> unit_bytes >> chunk_bits >> num_chunks >> code_bits)) {
    fail("bad " + dir + "/meta.txt");
  }
  if (row_bytes != kRowBytes) fail("the harness times fp32 rows of 128 values");
  TableView t{};
  t.payload = read_file(dir + "/payload.bin", true).data;
  t.block_base = reinterpret_cast<const int64_t*>(read_file(dir + "/block_base.bin", false).data);
  t.row_units = read_file(dir + "/row_units.bin", false).data;
  t.bitmask = reinterpret_cast<const int32_t*>(read_file(dir + "/bitmask.bin", false).data);
  t.mask = reinterpret_cast<const uint64_t*>(read_file(dir + "/mask.bin", false).data);
  t.bitval = reinterpret_cast<const uint64_t*>(read_file(dir + "/bitval.bin", false).data);
  t.num_rows = rows;
  t.row_bytes = row_bytes;
  t.unit_bytes = unit_bytes;
  t.chunk_bits = chunk_bits;
  t.num_chunks = num_chunks;
  t.code_bits = code_bits;
  return t;
}

// Pooled SUM over raw rows stored back to back, the way fbgemm's JIT kernel reads them.
void control(const uint8_t* rows, const std::vector<int64_t>& ids,
             const std::vector<int64_t>& offsets, float* out) {
  const auto n = static_cast<int64_t>(ids.size());
  for (size_t b = 0; b + 1 < offsets.size(); ++b) {
    __m256 acc[kVecs];
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
      if (i + kControlPrefetchDistance < n) {
        const uint8_t* ahead = rows + ids[i + kControlPrefetchDistance] * kRowBytes;
        for (int64_t line = 0; line < kRowBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        }
      }
      const auto* row = reinterpret_cast<const float*>(rows + ids[i] * kRowBytes);
      for (int v = 0; v < kVecs; ++v) acc[v] = _mm256_add_ps(acc[v], _mm256_loadu_ps(row + 8 * v));
    }
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + b * kDim + 8 * v, acc[v]);
  }
}

void engine(const ibpembed::RowKernels& kernels, const TableView& t,
            const std::vector<int64_t>& ids, const std::vector<int64_t>& offsets,
            int64_t bags_per_call, float* out) {
  const auto bags = static_cast<int64_t>(offsets.size()) - 1;
  for (int64_t first = 0; first < bags; first += bags_per_call) {
    ibpembed::lookup_pooled_cpu(kernels, t, ibpembed::DType::kFloat32, ids.data(),
                                offsets.data() + first, std::min(bags_per_call, bags - first),
                                nullptr, ibpembed::Pooling::kSum, out + first * kDim);
  }
}

template <class Pass>
double best_ns_per_lookup(const Pass& pass, int reps, int64_t lookups) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best / static_cast<double>(lookups) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) fail("usage: engine_harness DIR ROUNDS REPS BAGS_PER_CALL");
  if (!__builtin_cpu_supports("avx2")) fail("the control loop needs AVX2");
  const std::string dir = argv[1];
  const int rounds = std::atoi(argv[2]);
  const int reps = std::atoi(argv[3]);
  const int64_t bags_per_call = std::atoll(argv[4]);
  if (rounds < 1 || reps < 1 || bags_per_call < 1) fail("ROUNDS, REPS and BAGS_PER_CALL >= 1");
  const TableView raw = read_table(dir + "/raw");
  const TableView compressed = read_table(dir + "/compressed");
  const std::vector<int64_t> ids = read_int64s(dir + "/ids.bin");
  const std::vector<int64_t> offsets = read_int64s(dir + "/offsets.bin");
  const auto lookups = static_cast<int64_t>(ids.size());
  if (offsets.size() < 2 || offsets.front() != 0 || offsets.back() != lookups) {
    fail("offsets must run from 0 to the number of ids");
  }
  if (raw.num_rows != compressed.num_rows) fail("raw/ and compressed/ hold different row counts");
  for (const int64_t id : ids) {
    if (id < 0 || id >= raw.num_rows) fail("id out of range");
  }
  if (raw.block_base[(raw.num_rows + 31) / 32] != raw.num_rows * kRowBytes) {
    fail("raw/ must store every row raw, back to back");
  }
  // Read as the product reads an all-raw table (codec.py _raw_rows_as_tier): its payload is a
  // tier of every row, taken by the lean path without the index.
  TableView lean = raw;
  lean.tier_rows = raw.payload;
  lean.tier_stride = kRowBytes;
  lean.tier_num_rows = raw.num_rows;
  const size_t out_size = (offsets.size() - 1) * kDim;
  std::vector<float> out_control(out_size), out_raw(out_size), out_compressed(out_size);
  const ibpembed::RowKernels& kernels = ibpembed::row_kernels(ibpembed::active_cpu_path());
  for (int round = 0; round < rounds; ++round) {
    const double c = best_ns_per_lookup(
        [&] { control(raw.payload, ids, offsets, out_control.data()); }, reps, lookups);
    const double r = best_ns_per_lookup(
        [&] { engine(kernels, lean, ids, offsets, bags_per_call, out_raw.data()); }, reps, lookups);
    const double k = best_ns_per_lookup(
        [&] { engine(kernels, compressed, ids, offsets, bags_per_call, out_compressed.data()); },
        reps, lookups);
    std::printf(
        "{\"round\": %d, \"control_ns\": %.3f, \"raw_ns\": %.3f, \"compressed_ns\": %.3f}\n", round,
        c, r, k);
    std::fflush(stdout);
  }
  const size_t bytes = out_size * sizeof(float);
  const bool agree = std::memcmp(out_control.data(), out_raw.data(), bytes) == 0 &&
                     std::memcmp(out_raw.data(), out_compressed.data(), bytes) == 0;
  std::printf("{\"agree\": %s}\n", agree ? "true" : "false");
  return agree ? 0 : 1;
}
