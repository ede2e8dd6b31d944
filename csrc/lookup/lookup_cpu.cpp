// SPDX-License-Identifier: Apache-2.0
//
// CPU gather and pooled lookup: split across threads with at::parallel_for, decode rows in
// batches into an L2-sized scratch buffer, then accumulate. Inputs are validated by the caller.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "accumulate.h"
#include "ibpembed/lookup.h"
#include "ibpembed/numeric.h"

namespace ibpembed {
namespace {

// Rows decoded per decode_rows call: enough to amortise its per-call setup and keep its prefetch
// pipeline full, few enough bytes to stay in L2.
constexpr int64_t kDecodeBatchBytes = 128 * 1024;
constexpr int64_t kMaxDecodeBatch = 256;

int64_t decode_batch_rows(int64_t row_bytes) {
  return std::max<int64_t>(16, std::min(kMaxDecodeBatch, kDecodeBatchBytes / row_bytes));
}
// Grain sizes: below these a thread's share is not worth the fork.
constexpr int64_t kGatherGrain = 256;
constexpr int64_t kBagGrain = 32;

void accumulate_portable(DType dtype, const uint8_t* row, int64_t dim, float weight, float* acc) {
  accumulate_row(dtype, row, dim, weight, acc);
}

}  // namespace

AccumulateFn select_accumulate() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return &accumulate_row_avx2;
#endif
  return &accumulate_portable;
}

void gather_rows_cpu(const RowKernels& k, const TableView& t, const int64_t* indices, int64_t n,
                     uint8_t* out) {
  at::parallel_for(0, n, kGatherGrain, [&](int64_t begin, int64_t end) {
    k.decode_rows(t, indices + begin, end - begin, 0, out + begin * t.row_bytes, nullptr);
  });
}

void lookup_pooled_cpu(const RowKernels& k, const TableView& t, DType dtype,
                       const int64_t* indices, const int64_t* offsets, int64_t num_bags,
                       const float* per_sample_weights, Pooling pooling, float* out) {
  static const AccumulateFn accumulate = select_accumulate();
  const int64_t dim = pooled_dim(dtype, t.row_bytes);
  at::parallel_for(0, num_bags, kBagGrain, [&](int64_t bag_begin, int64_t bag_end) {
    const int64_t batch = decode_batch_rows(t.row_bytes);
    std::vector<uint8_t> scratch(static_cast<size_t>(batch * t.row_bytes));
    std::vector<const uint8_t*> rows(static_cast<size_t>(batch));
    float* const out_begin = out + bag_begin * dim;
    std::fill(out_begin, out + bag_end * dim, 0.0f);
    // Walk this thread's indices in fixed batches that ignore bag boundaries, so short bags
    // (pooling factor 1) still get a full prefetch pipeline.
    const int64_t first = offsets[bag_begin];
    const int64_t last = offsets[bag_end];
    int64_t bag = bag_begin;
    for (int64_t s = first; s < last; s += batch) {
      const int64_t m = std::min(batch, last - s);
      // Raw rows are summed in place from the payload; only compressed rows use the scratch.
      k.decode_rows(t, indices + s, m, std::min(batch, last - s - m), scratch.data(), rows.data());
      for (int64_t i = 0; i < m; ++i) {
        const int64_t idx = s + i;
        while (offsets[bag + 1] <= idx) ++bag;
        const float w = per_sample_weights != nullptr ? per_sample_weights[idx] : 1.0f;
        accumulate(dtype, rows[i], dim, w, out + bag * dim);
      }
    }
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
