// SPDX-License-Identifier: Apache-2.0
//
// CPU gather and pooled lookup: split across threads with at::parallel_for; pooled lookups sum
// each row as decode_rows hands it over (fused, no decoded batch in memory). A table with a
// decoded tier (format.h TableView::tier_rows) takes the lean path: a pre-pass resolves every id
// to its tier row, tier rows are pooled straight from there, and only the misses go through
// decode_rows. Inputs are validated by the caller.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../ops/parallel.h"
#include "accumulate.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"
#include "ibpembed/tier.h"

namespace ibpembed {
namespace {

// Grain sizes: below these a thread's share is not worth the fork.
constexpr int64_t kGatherGrain = 256;
constexpr int64_t kBagGrain = 32;
// A thread's repeat cache (codec.h) holds up to this many bytes of decoded rows, about half of a
// Zen 4 / Sapphire Rapids core's L2, and at most 2^kRepeatMaxSlotBits rows. On the Zipf batches
// of benchmarks/data.py a direct-mapped cache of 1,024 rows catches 40 of the 55 % repeated
// lookups on 8.4M rows, 53 of 71 % on 100k rows (simulated while building it).
constexpr int64_t kRepeatCacheBytes = int64_t{512} << 10;
constexpr int kRepeatMaxSlotBits = 12;

// Slots of a repeat cache for a call decoding num_ids rows: enough for every id, within the
// byte budget; 0 = no cache (a single id, or rows too wide for two slots).
int repeat_slot_bits(int64_t num_ids, int64_t row_bytes) {
  int bits = 0;
  while (bits < kRepeatMaxSlotBits && (int64_t{1} << bits) < num_ids &&
         (int64_t{2} << bits) * row_bytes <= kRepeatCacheBytes) {
    ++bits;
  }
  return bits;
}

// One thread's RepeatCache, reset for each call. The memory stays with the thread for its next
// call: freeing it let glibc hand the pages back, and faulting 512 KiB in again cost ~7 % of a
// 1.4 ms lookup (development A/B).
RepeatCache* thread_repeat_cache(int64_t num_ids, int64_t row_bytes) {
  struct Storage {
    // Uninitialised: a slot is decoded into before any row that found it reaches the sink.
    std::unique_ptr<uint8_t[]> rows;
    size_t capacity = 0;
    std::vector<RepeatCache::Slot> slots;
    RepeatCache cache{};
  };
  thread_local Storage storage;
  const int bits = repeat_slot_bits(num_ids, row_bytes);
  if (bits == 0) return nullptr;
  const size_t slots = size_t{1} << bits;
  const size_t bytes = slots * static_cast<size_t>(row_bytes);
  if (storage.capacity < bytes) {
    storage.rows.reset(new uint8_t[bytes]);
    storage.capacity = bytes;
  }
  storage.slots.assign(slots, RepeatCache::Slot{-1, -1});
  storage.cache = RepeatCache{storage.rows.get(), storage.slots.data(), bits, row_bytes};
  return &storage.cache;
}

// One thread's buffer for the rows a pooled call decodes in a round (decode_rows' `out` with a
// sink), kept for its next calls: allocated per call, its zero-filling cost ~0.5 us per table
// read, and a request reads up to 26 tables. Uninitialised: rows are decoded into it before the
// sink reads them.
uint8_t* thread_round_buffer(int64_t bytes) {
  thread_local std::unique_ptr<uint8_t[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < bytes) {
    buffer.reset(new uint8_t[static_cast<size_t>(bytes)]);
    capacity = bytes;
  }
  return buffer.get();
}

void pool_rows_portable(DType dtype, const uint8_t* const* rows, const float* weights,
                        int64_t count, int64_t dim, float* acc, const PrefetchAhead& ahead) {
  for (int64_t k = 0; k < count; ++k) {
    prefetch_ahead(ahead, k);
    accumulate_row(dtype, rows[k], dim, weights != nullptr ? weights[k] : 1.0f, acc);
  }
}

void pool_bags_portable(DType dtype, const uint8_t* const* rows, const float* weights,
                        const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim,
                        float* out, const PrefetchAhead& ahead) {
  pool_bags_by_runs(&pool_rows_portable, dtype, rows, weights, offsets, num_bags, base, dim, out,
                    ahead);
}

// The bags from `bag` on that end by row `until` (ids first + [0, until)), bounded by bag_end.
int64_t whole_bags_until(const int64_t* offsets, int64_t bag, int64_t bag_end, int64_t first,
                         int64_t until) {
  int64_t last = bag;
  while (last < bag_end && offsets[last + 1] - first <= until) ++last;
  return last - bag;
}

// One thread's share of a pooled lookup, fed a round of rows at a time by decode_rows. The
// indices are walked in one pass that ignores bag boundaries, so short bags (pooling factor 1)
// still keep the decode pipeline full; a round's whole bags are pooled here in one call, a bag
// the round cuts a run at a time.
struct BagPooler {
  PoolLoops pool;
  DType dtype;
  int64_t dim;
  const int64_t* offsets;
  const float* weights;  // nullable; indexed like the ids
  float* out;
  int64_t first;    // index of the thread's first id
  int64_t bag;      // bag of the next id
  int64_t bag_end;  // the thread's bags end here

  static void consume(void* self, int64_t first, int64_t count, const uint8_t* const* rows) {
    auto& p = *static_cast<BagPooler*>(self);
    const int64_t round_begin = p.first + first;
    for (int64_t k = 0; k < count;) {
      const int64_t idx = round_begin + k;
      while (p.offsets[p.bag + 1] <= idx) ++p.bag;  // skips empty bags
      const int64_t whole = idx == p.offsets[p.bag]
                                ? whole_bags_until(p.offsets, p.bag, p.bag_end, round_begin, count)
                                : 0;
      if (whole > 0) {
        p.pool.bags(p.dtype, rows, p.weights != nullptr ? p.weights + round_begin : nullptr,
                    p.offsets + p.bag, whole, round_begin, p.dim, p.out + p.bag * p.dim,
                    PrefetchAhead{});
        p.bag += whole;
        k = p.offsets[p.bag] - round_begin;
        continue;
      }
      const int64_t run = std::min(count, p.offsets[p.bag + 1] - round_begin) - k;
      p.pool.rows(p.dtype, rows + k, p.weights != nullptr ? p.weights + idx : nullptr, run, p.dim,
                  p.out + p.bag * p.dim, PrefetchAhead{});
      k += run;
    }
  }
};

// The lean path's prefetch distance in rows: fbgemm's CPU loop prefetches 16 ids ahead.
constexpr int64_t kTierAhead = 16;

// Bytes of a row the lean path prefetches kTierAhead ids ahead. NOTE(lookup): fp32 rows take
// their first line only: a software prefetch holds an L1 fill buffer until its line arrives, and
// eight lines a row, 16 rows ahead, kept the buffers full while the fast fp32 loop waited on its
// own prefetches; the core's prefetchers bring the row's other lines once its first is asked
// for. Rows that take longer to pool per line (bf16, converted as they are added) keep every
// line: there the single line left the loop waiting on the others. Raw-row lookups from 2 GiB
// tables on the Intel Xeon VM (one thread, alternating builds, M lookups/s, all lines -> first
// line): fp32 D = 128 uniform 10.1-10.3 -> 11.6-13.0, Zipf 1.05 22.5-24.5 -> 27.8-30.1; D = 384
// Zipf 1.05 8.7-9.1 -> 10.9-11.8; D = 64 within noise; bf16 D = 128 Zipf 1.05 26.5-28.7 ->
// 22.4-23.7 and D = 256 18.5-19.8 -> 14.0-14.7. Two lines, every other line, the last line, or
// the lines into L2 were no better than these. fp16 and int8 rows keep every line, the loop's
// earlier behaviour: not measured either way.
int64_t lean_prefetch_bytes(DType dtype, int64_t row_bytes) {
  return dtype == DType::kFloat32 ? std::min<int64_t>(64, row_bytes) : row_bytes;
}

// One thread's buffers for the lean path (row pointers per id, the misses), kept for its next
// calls like the round buffer.
struct TierBuffers {
  std::vector<const uint8_t*> rows;
  std::vector<int64_t> miss_ids;
  std::vector<int64_t> miss_at;
};

TierBuffers& thread_tier_buffers(int64_t num_ids) {
  thread_local TierBuffers buffers;
  buffers.rows.resize(static_cast<size_t>(num_ids));
  buffers.miss_ids.clear();
  buffers.miss_at.clear();
  return buffers;
}

// One thread's share of a pooled lookup on the lean path: rows[i] is id first + i's row, pooled
// in index order (whole bags in one call, a bag cut by a pending miss a run at a time), with the
// rows kTierAhead ids ahead prefetched meanwhile.
// Misses reach rows[] a round at a time from decode_rows (consume), and every id up to a
// round's last miss is pooled before the round's rows go stale.
struct LeanPooler {
  PoolLoops pool;
  DType dtype;
  int64_t dim;
  int64_t prefetch_bytes;  // lean_prefetch_bytes()
  const int64_t* offsets;
  const float* weights;  // nullable; indexed like the ids
  float* out;
  const uint8_t** rows;  // [n]
  const int64_t* miss_at;
  int64_t first;  // index of the thread's first id
  int64_t n;
  int64_t bag;       // bag of the next id
  int64_t bag_end;   // the thread's bags end here
  int64_t next = 0;  // the next id to pool, from first

  void pool_until(int64_t until) {
    while (next < until) {
      const int64_t idx = first + next;
      while (offsets[bag + 1] <= idx) ++bag;  // skips empty bags
      const int64_t whole =
          idx == offsets[bag] ? whole_bags_until(offsets, bag, bag_end, first, until) : 0;
      if (whole > 0) {
        pool.bags(
            dtype, rows, weights != nullptr ? weights + first : nullptr, offsets + bag, whole,
            first, dim, out + bag * dim,
            PrefetchAhead{rows + kTierAhead, std::max<int64_t>(0, n - kTierAhead), prefetch_bytes});
        bag += whole;
        next = offsets[bag] - first;
        continue;
      }
      const int64_t run = std::min(until, offsets[bag + 1] - first) - next;
      const int64_t ahead = std::max<int64_t>(0, std::min(run, n - next - kTierAhead));
      pool.rows(dtype, rows + next, weights != nullptr ? weights + idx : nullptr, run, dim,
                out + bag * dim, PrefetchAhead{rows + next + kTierAhead, ahead, prefetch_bytes});
      next += run;
    }
  }

  static void consume(void* self, int64_t first, int64_t count, const uint8_t* const* rows) {
    auto& p = *static_cast<LeanPooler*>(self);
    for (int64_t k = 0; k < count; ++k) p.rows[p.miss_at[first + k]] = rows[k];
    p.pool_until(p.miss_at[first + count - 1] + 1);
  }
};

// Resolves ids[0, n) to tier rows: rows[i] for a hit, null and a miss entry otherwise. The
// directory entries are prefetched kTierAhead ids ahead (16 bytes per 64 rows: a few MiB at
// most, and Zipf keeps the hot ones cached).
void resolve_tier(const TableView& t, const int64_t* ids, int64_t n, TierBuffers& b) {
  if (t.tier_dir == nullptr) {
    for (int64_t i = 0; i < n; ++i) b.rows[i] = t.tier_rows + ids[i] * t.tier_stride;
    return;
  }
  // Stored through a local pointer: through `b` (a thread_local), GCC 12 reloaded rows' data
  // with a TLS lookup per id once the loop could throw, 7 % of a pooled lookup of tier rows
  // (development A/B).
  const uint8_t** rows = b.rows.data();
  for (int64_t i = 0; i < n; ++i) {
    if (i + kTierAhead < n) __builtin_prefetch(t.tier_dir + 2 * (ids[i + kTierAhead] >> 6), 0, 3);
    const int64_t slot = tier_slot(t, ids[i]);
    if (slot >= 0) {
      rows[i] = t.tier_rows + slot * t.tier_stride;
    } else if (slot == kNotInTier) {
      rows[i] = nullptr;
      b.miss_ids.push_back(ids[i]);
      b.miss_at.push_back(i);
    } else {
      throw_corrupt_table(ids[i], kBadTierSlotWhat);
    }
  }
}

void scale_mean(const int64_t* offsets, int64_t bag_begin, int64_t bag_end, int64_t dim,
                float* out) {
  for (int64_t b = bag_begin; b < bag_end; ++b) {
    const int64_t len = offsets[b + 1] - offsets[b];
    if (len == 0) continue;
    const float inv = 1.0f / static_cast<float>(len);
    for (int64_t d = 0; d < dim; ++d) out[b * dim + d] *= inv;
  }
}

struct NamedPoolLoops {
  const char* name;
  PoolLoops loops;
  bool (*runs)();
};

#if defined(__x86_64__)
// AVX-512F alone (accumulate_avx512.cpp's only flag), not the decoders' VBMI2 (cpu_has_avx512):
// Skylake-SP and Cascade Lake hosts pool with 16 lanes too. __builtin_cpu_supports also checks
// that the OS saves the AVX-512 state.
bool cpu_runs_avx512_pooling() { return __builtin_cpu_supports("avx512f"); }
bool cpu_runs_avx2_pooling() { return __builtin_cpu_supports("avx2"); }
#endif

bool cpu_runs_portable_pooling() { return true; }

// Widest first. The x86 loops are named only where they are built: an aarch64 build has no
// accumulate_avx*.cpp objects to link them from.
constexpr NamedPoolLoops kPoolLoops[] = {
#if defined(__x86_64__)
    {"avx512", {&pool_rows_avx512, &pool_bags_avx512}, &cpu_runs_avx512_pooling},
    {"avx2", {&pool_rows_avx2, &pool_bags_avx2}, &cpu_runs_avx2_pooling},
#endif
    {"portable", {&pool_rows_portable, &pool_bags_portable}, &cpu_runs_portable_pooling},
};
constexpr int kNumPoolLoops = sizeof(kPoolLoops) / sizeof(kPoolLoops[0]);

int widest_pool_loops() {
  int i = 0;
  while (!kPoolLoops[i].runs()) ++i;  // the portable loops always run
  return i;
}

std::atomic<int>& active_pool_loops() {
  static std::atomic<int> active{widest_pool_loops()};
  return active;
}

}  // namespace

PoolLoops select_pool_loops() {
  return kPoolLoops[active_pool_loops().load(std::memory_order_relaxed)].loops;
}

const char* pool_loops_name() {
  return kPoolLoops[active_pool_loops().load(std::memory_order_relaxed)].name;
}

std::vector<std::string> available_pool_loops() {
  std::vector<std::string> names;
  for (const NamedPoolLoops& set : kPoolLoops) {
    if (set.runs()) names.emplace_back(set.name);
  }
  return names;
}

bool set_pool_loops(const std::string& name) {
  for (int i = 0; i < kNumPoolLoops; ++i) {
    if (name == kPoolLoops[i].name && kPoolLoops[i].runs()) {
      active_pool_loops().store(i, std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

void gather_rows_cpu(const RowKernels& k, const TableView& t, const int64_t* indices, int64_t n,
                     uint8_t* out) {
  if (t.tier_rows != nullptr && t.tier_dir == nullptr) {  // every row in the tier: copies
    at::parallel_for(0, n, kGatherGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(out + i * t.row_bytes, t.tier_rows + indices[i] * t.tier_stride,
                    static_cast<size_t>(t.row_bytes));
      }
    });
    return;
  }
  at::parallel_for(0, n, kGatherGrain, [&](int64_t begin, int64_t end) {
    k.decode_rows(t, indices + begin, end - begin, out + begin * t.row_bytes, nullptr);
  });
}

void lookup_pooled_cpu(const RowKernels& k, const TableView& t, DType dtype, const int64_t* indices,
                       const int64_t* offsets, int64_t num_bags, const float* per_sample_weights,
                       Pooling pooling, float* out) {
  const PoolLoops pool = select_pool_loops();
  const int64_t dim = pooled_dim(dtype, t.row_bytes);
  // Misses are read through the index alone: the decoder never looks at the tier again.
  TableView cold = t;
  cold.tier_dir = nullptr;
  cold.tier_rows = nullptr;
  at::parallel_for(0, num_bags, kBagGrain, [&](int64_t bag_begin, int64_t bag_end) {
    std::fill(out + bag_begin * dim, out + bag_end * dim, 0.0f);
    const int64_t first = offsets[bag_begin];
    const int64_t num_ids = offsets[bag_end] - first;
    if (t.tier_rows == nullptr) {
      BagPooler pooler{
          pool, dtype, dim, offsets, per_sample_weights, out, first, bag_begin, bag_end,
      };
      const RowSink sink{&BagPooler::consume, &pooler, thread_repeat_cache(num_ids, t.row_bytes)};
      uint8_t* round = thread_round_buffer(kDecodeStageRows * t.row_bytes);
      k.decode_rows(t, indices + first, num_ids, round, &sink);
    } else {
      TierBuffers& b = thread_tier_buffers(num_ids);
      resolve_tier(t, indices + first, num_ids, b);
      LeanPooler pooler{pool,
                        dtype,
                        dim,
                        lean_prefetch_bytes(dtype, t.row_bytes),
                        offsets,
                        per_sample_weights,
                        out,
                        b.rows.data(),
                        b.miss_at.data(),
                        first,
                        num_ids,
                        bag_begin,
                        bag_end};
      if (!b.miss_ids.empty()) {
        const auto misses = static_cast<int64_t>(b.miss_ids.size());
        const RowSink sink{&LeanPooler::consume, &pooler, thread_repeat_cache(misses, t.row_bytes)};
        uint8_t* round = thread_round_buffer(kDecodeStageRows * t.row_bytes);
        k.decode_rows(cold, b.miss_ids.data(), misses, round, &sink);
      }
      pooler.pool_until(num_ids);
    }
    if (pooling == Pooling::kMean) scale_mean(offsets, bag_begin, bag_end, dim, out);
  });
}

}  // namespace ibpembed
