// SPDX-License-Identifier: Apache-2.0
//
// CPU gather and pooled lookup: split across threads with at::parallel_for; pooled lookups sum
// each row as decode_rows hands it over (fused, no decoded batch in memory). Inputs are validated
// by the caller.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../ops/parallel.h"
#include "accumulate.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"

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
                        int64_t count, int64_t dim, float* acc) {
  for (int64_t k = 0; k < count; ++k) {
    accumulate_row(dtype, rows[k], dim, weights != nullptr ? weights[k] : 1.0f, acc);
  }
}

// One thread's share of a pooled lookup, fed a round of rows at a time by decode_rows. The
// indices are walked in one pass that ignores bag boundaries, so short bags (pooling factor 1)
// still keep the decode pipeline full; each round is cut into per-bag runs here.
struct BagPooler {
  PoolRowsFn pool_rows;
  DType dtype;
  int64_t dim;
  const int64_t* offsets;
  const float* weights;  // nullable; indexed like the ids
  float* out;
  int64_t first;  // index of the thread's first id
  int64_t bag;    // bag of the next id

  static void consume(void* self, int64_t first, int64_t count, const uint8_t* const* rows) {
    auto& p = *static_cast<BagPooler*>(self);
    const int64_t round_begin = p.first + first;
    for (int64_t k = 0; k < count;) {
      const int64_t idx = round_begin + k;
      while (p.offsets[p.bag + 1] <= idx) ++p.bag;  // skips empty bags
      const int64_t run = std::min(count, p.offsets[p.bag + 1] - round_begin) - k;
      p.pool_rows(p.dtype, rows + k, p.weights != nullptr ? p.weights + idx : nullptr, run, p.dim,
                  p.out + p.bag * p.dim);
      k += run;
    }
  }
};

}  // namespace

PoolRowsFn select_pool_rows() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return &pool_rows_avx2;
#endif
  return &pool_rows_portable;
}

void gather_rows_cpu(const RowKernels& k, const TableView& t, const int64_t* indices, int64_t n,
                     uint8_t* out) {
  at::parallel_for(0, n, kGatherGrain, [&](int64_t begin, int64_t end) {
    k.decode_rows(t, indices + begin, end - begin, out + begin * t.row_bytes, nullptr);
  });
}

void lookup_pooled_cpu(const RowKernels& k, const TableView& t, DType dtype,
                       const int64_t* indices, const int64_t* offsets, int64_t num_bags,
                       const float* per_sample_weights, Pooling pooling, float* out) {
  static const PoolRowsFn pool_rows = select_pool_rows();
  const int64_t dim = pooled_dim(dtype, t.row_bytes);
  at::parallel_for(0, num_bags, kBagGrain, [&](int64_t bag_begin, int64_t bag_end) {
    std::fill(out + bag_begin * dim, out + bag_end * dim, 0.0f);
    const int64_t first = offsets[bag_begin];
    const int64_t num_ids = offsets[bag_end] - first;
    BagPooler pooler{pool_rows, dtype, dim, offsets, per_sample_weights, out, first, bag_begin};
    const RowSink sink{&BagPooler::consume, &pooler, thread_repeat_cache(num_ids, t.row_bytes)};
    uint8_t* round = thread_round_buffer(kDecodeStageRows * t.row_bytes);
    k.decode_rows(t, indices + first, num_ids, round, &sink);
    if (pooling == Pooling::kMean) {
      for (int64_t b = bag_begin; b < bag_end; ++b) {
        const int64_t len = offsets[b + 1] - offsets[b];
        if (len == 0) continue;
        const float inv = 1.0f / static_cast<float>(len);
        for (int64_t d = 0; d < dim; ++d) out[b * dim + d] *= inv;
      }
    }
  });
}

}  // namespace ibpembed
