// SPDX-License-Identifier: Apache-2.0
//
// Mask fitting. Every method starts from a bit census of the sample; the greedy method then makes
// one more pass to count, per chunk position, how many rows agree with the majority on each
// prefix of the agreement ranking; the codebook fit (C > 1) counts the patterns of each prefix.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>
#include <vector>

#include "ibpembed/bits.h"
#include "ibpembed/codec.h"

namespace ibpembed {
namespace {

// ones[b * 8 + t] = number of sample rows whose byte b has bit t set. Counted through per-byte
// value histograms (one increment per byte instead of one per bit).
std::vector<int64_t> bit_census(const SampleRows& sample) {
  const int64_t row_bytes = sample.width;
  std::vector<uint32_t> hist(static_cast<size_t>(row_bytes) * 256, 0);
  std::vector<int64_t> ones(static_cast<size_t>(row_bytes) * 8, 0);
  // uint32 histograms: flush before any bin could overflow.
  constexpr int64_t kFlushRows = int64_t{1} << 31;
  auto flush = [&] {
    for (int64_t b = 0; b < row_bytes; ++b) {
      for (int v = 0; v < 256; ++v) {
        const uint32_t c = hist[b * 256 + v];
        if (c == 0) continue;
        for (int t = 0; t < 8; ++t) {
          if ((v >> t) & 1) ones[b * 8 + t] += c;
        }
      }
    }
    std::fill(hist.begin(), hist.end(), 0u);
  };
  for (int64_t r = 0; r < sample.num_rows; ++r) {
    const uint8_t* row = sample.row(r);
    for (int64_t b = 0; b < row_bytes; ++b) ++hist[b * 256 + row[b]];
    if ((r + 1) % kFlushRows == 0) flush();
  }
  flush();
  return ones;
}

// Count of ones of bit t of chunk j; bits past the row end are padding (always zero).
int64_t chunk_bit_ones(const std::vector<int64_t>& ones, int64_t row_bytes, int chunk_bits, int j,
                       int t) {
  const int64_t bit = static_cast<int64_t>(j) * chunk_bits + t;
  return bit < row_bytes * 8 ? ones[bit] : 0;
}

// Inlined: the fits call it per row and position, where the switch is a predicted branch.
[[gnu::always_inline]] inline uint64_t load_chunk_any(const uint8_t* row, int64_t row_bytes,
                                                      int chunk_bits, int j) {
  switch (chunk_bits) {
    case 16: return load_chunk<16>(row, row_bytes, j);
    case 32: return load_chunk<32>(row, row_bytes, j);
    default: return load_chunk<64>(row, row_bytes, j);
  }
}

// The W bits of chunk position j, most agreeing with their majority value first (agreement =
// max(ones, n - ones)); ties by bit index.
std::array<uint8_t, 64> rank_bits(const std::vector<int64_t>& ones, int64_t n, int64_t row_bytes,
                                  int w, int j) {
  std::array<int64_t, 64> agree{};
  for (int t = 0; t < w; ++t) {
    const int64_t c = chunk_bit_ones(ones, row_bytes, w, j, t);
    agree[t] = std::max(c, n - c);
  }
  std::array<uint8_t, 64> order{};
  std::iota(order.begin(), order.begin() + w, 0);
  std::stable_sort(order.begin(), order.begin() + w,
                   [&](uint8_t a, uint8_t b) { return agree[a] > agree[b]; });
  return order;
}

// prefix_rows[j * (w + 1) + L] = rows whose chunk j agrees with the majority on exactly the
// first L ranked bits (L = w: on all of them), i.e. L = the best rank among the bits where the
// chunk differs from the majority (w when none does). NOTE(codec): counted a byte of the row at
// a time: first_rank[i * 256 + x] is the best rank among the bits set in x at row byte i, so a
// position costs one table lookup and one min per byte instead of w prefix tests.
std::vector<int64_t> count_agreeing_prefixes(const SampleRows& sample, int w,
                                             const std::vector<uint64_t>& majority,
                                             const std::vector<std::array<uint8_t, 64>>& ranking) {
  const int v = static_cast<int>(majority.size());
  const int64_t row_bytes = sample.width;
  const int chunk_bytes = w / 8;
  std::vector<uint8_t> first_rank(static_cast<size_t>(row_bytes) * 256, static_cast<uint8_t>(w));
  std::vector<uint8_t> majority_bytes(static_cast<size_t>(row_bytes));
  for (int64_t i = 0; i < row_bytes; ++i) {
    majority_bytes[i] = static_cast<uint8_t>(majority[i / chunk_bytes] >> (8 * (i % chunk_bytes)));
  }
  for (int j = 0; j < v; ++j) {
    for (int k = w - 1; k >= 0; --k) {  // best rank last, so it wins
      const int64_t i = static_cast<int64_t>(j) * chunk_bytes + ranking[j][k] / 8;
      if (i >= row_bytes) continue;  // padding past the row's end never differs
      const int bit = ranking[j][k] % 8;
      uint8_t* table = first_rank.data() + i * 256;
      for (int x = 0; x < 256; ++x) {
        if ((x >> bit) & 1) table[x] = std::min(table[x], static_cast<uint8_t>(k));
      }
    }
  }
  std::vector<int64_t> prefix_rows(static_cast<size_t>(v) * (w + 1), 0);
  for (int64_t r = 0; r < sample.num_rows; ++r) {
    const uint8_t* row = sample.row(r);
    for (int j = 0; j < v; ++j) {
      const int64_t first = static_cast<int64_t>(j) * chunk_bytes;
      const int64_t last = std::min(first + chunk_bytes, row_bytes);
      uint8_t len = static_cast<uint8_t>(w);
      for (int64_t i = first; i < last; ++i) {
        len = std::min(len, first_rank[i * 256 + (row[i] ^ majority_bytes[i])]);
      }
      ++prefix_rows[static_cast<size_t>(j) * (w + 1) + len];
    }
  }
  return prefix_rows;
}

ChunkMasks fit_greedy(const SampleRows& sample, int w) {
  const int64_t n = sample.num_rows;
  const int64_t row_bytes = sample.width;
  const int v = chunks_per_row(row_bytes, w);
  const std::vector<int64_t> ones = bit_census(sample);
  ChunkMasks out{std::vector<uint64_t>(v, 0), std::vector<uint64_t>(v, 0)};

  // Per position: majority word and the bit ranking.
  std::vector<uint64_t> majority(v, 0);
  std::vector<std::array<uint8_t, 64>> ranking(v);
  for (int j = 0; j < v; ++j) {
    for (int t = 0; t < w; ++t) {
      if (2 * chunk_bit_ones(ones, row_bytes, w, j, t) > n) majority[j] |= uint64_t{1} << t;
    }
    ranking[j] = rank_bits(ones, n, row_bytes, w, j);
  }

  const std::vector<int64_t> prefix_rows = count_agreeing_prefixes(sample, w, majority, ranking);

  for (int j = 0; j < v; ++j) {
    // saving(k) = k * rows agreeing on the top-k bits; keep the smallest k of maximal saving
    // (fewer mask bits let more unseen rows participate at equal sample saving).
    int64_t matching = 0;
    std::vector<int64_t> match_at(w + 1, 0);
    for (int k = w; k >= 0; --k) {
      matching += prefix_rows[static_cast<size_t>(j) * (w + 1) + k];
      match_at[k] = matching;
    }
    int best_k = 0;
    int64_t best_saving = 0;
    for (int k = 1; k <= w; ++k) {
      const int64_t saving = static_cast<int64_t>(k) * match_at[k];
      if (saving > best_saving) {
        best_saving = saving;
        best_k = k;
      }
    }
    uint64_t mask = 0;
    for (int i = 0; i < best_k; ++i) mask |= uint64_t{1} << ranking[j][i];
    out.mask[j] = mask;
    out.bitval[j] = majority[j] & mask;
  }
  return out;
}

// Sum of the k largest of counts[0, size).
int64_t top_k_sum(const int64_t* counts, int64_t size, int k) {
  std::array<int64_t, 16> top{};  // descending; k <= 15
  for (int64_t i = 0; i < size; ++i) {
    const int64_t c = counts[i];
    if (c <= top[k - 1]) continue;
    int p = k - 1;
    while (p > 0 && top[p - 1] < c) {
      top[p] = top[p - 1];
      --p;
    }
    top[p] = c;
  }
  return std::accumulate(top.begin(), top.begin() + k, int64_t{0});
}

// The bit ranking of the codebook fit: greedy, each next bit the one best predicted by the bits
// already ranked (sum over the rows' current prefix patterns of the majority count of the bit;
// ties by bit index), on the first kCodebookRankRows rows.
//
// NOTE(codec): single-bit agreement (rank_bits) is the wrong order for codebooks. A float's top
// mantissa bit is skewed (about 58 % zeros for log-uniform values) while its lowest exponent bit
// is a coin flip on its own, yet determined by the exponent's other bits for most rows: ranked
// alone it comes after the mantissa bit and the exponent never ends up whole in the mask.
std::array<uint8_t, 64> rank_bits_conditional(const SampleRows& sample, int w, int j, int depth) {
  const int64_t n = std::min(sample.num_rows, kCodebookRankRows);
  std::vector<uint64_t> chunks(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) chunks[r] = load_chunk_any(sample.row(r), sample.width, w, j);
  const auto count_bits = [](uint64_t x, int32_t* ones) {
    for (; x != 0; x &= x - 1) ++ones[__builtin_ctzll(x)];
  };
  // Rows are grouped by their pattern of the bits ranked so far (dense ids of the non-empty
  // groups); ones[g * w + b] counts the rows of group g with bit b set.
  std::vector<int32_t> group(static_cast<size_t>(n), 0);
  int32_t groups = 1;
  std::vector<int32_t> ones(static_cast<size_t>(w), 0), sizes{static_cast<int32_t>(n)};
  for (int64_t r = 0; r < n; ++r) count_bits(chunks[r], ones.data());
  std::vector<int32_t> next_ones, next_sizes, child;
  std::vector<uint8_t> counted_side;
  std::array<uint8_t, 64> order{};
  uint64_t ranked = 0;
  for (int s = 0; s < depth; ++s) {
    if (groups == n) {
      // Every row is its own group: each bit is predicted perfectly, so the ties go in bit order.
      for (int b = 0; b < w && s < depth; ++b) {
        if (!((ranked >> b) & 1)) order[s++] = static_cast<uint8_t>(b);
      }
      break;
    }
    int best = -1;
    int64_t best_score = -1;
    for (int b = 0; b < w; ++b) {
      if ((ranked >> b) & 1) continue;
      int64_t score = 0;
      for (int32_t g = 0; g < groups; ++g) {
        const int32_t c = ones[static_cast<size_t>(g) * w + b];
        score += std::max(c, sizes[g] - c);
      }
      if (score > best_score) {
        best_score = score;
        best = b;
      }
    }
    order[s] = static_cast<uint8_t>(best);
    ranked |= uint64_t{1} << best;
    // Split every group on the ranked bit. NOTE(codec): the bit counts are counted for the
    // smaller child only, the other's are the parent's minus those: the ranked bits are the
    // predictable ones, so most rows land in the larger child and are never counted again.
    child.assign(static_cast<size_t>(groups) * 2, -1);
    counted_side.resize(static_cast<size_t>(groups));
    int32_t next = 0;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t set = ones[static_cast<size_t>(g) * w + best];
      if (sizes[g] - set > 0) child[2 * g] = next++;
      if (set > 0) child[2 * g + 1] = next++;
      counted_side[g] = set < sizes[g] - set ? 1 : 0;
    }
    next_ones.assign(static_cast<size_t>(next) * w, 0);
    next_sizes.assign(static_cast<size_t>(next), 0);
    for (int64_t r = 0; r < n; ++r) {
      const int32_t parent = group[r];
      const int bit = static_cast<int>((chunks[r] >> best) & 1);
      const int32_t id = child[2 * parent + bit];
      group[r] = id;
      ++next_sizes[id];
      if (bit == counted_side[parent]) {
        count_bits(chunks[r], next_ones.data() + static_cast<size_t>(id) * w);
      }
    }
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t counted = child[2 * g + counted_side[g]];
      const int32_t derived = child[2 * g + 1 - counted_side[g]];
      const int32_t* parent_ones = ones.data() + static_cast<size_t>(g) * w;
      int32_t* out = next_ones.data() + static_cast<size_t>(derived) * w;
      for (int b = 0; b < w; ++b) {
        out[b] =
            parent_ones[b] - (counted < 0 ? 0 : next_ones[static_cast<size_t>(counted) * w + b]);
      }
    }
    ones.swap(next_ones);
    sizes.swap(next_sizes);
    groups = next;
  }
  return order;
}

ChunkMasks fit_paper(const SampleRows& sample, int w) {
  const int64_t n = sample.num_rows;
  const int64_t row_bytes = sample.width;
  const int v = chunks_per_row(row_bytes, w);
  const std::vector<int64_t> ones = bit_census(sample);
  ChunkMasks best{std::vector<uint64_t>(v, 0), std::vector<uint64_t>(v, 0)};
  int64_t best_net = -1;
  // The published sweep: T from 0.70 in float32 steps of 0.05 while T <= 1.0.
  for (float threshold = 0.70f; threshold <= 1.0f; threshold += 0.05f) {
    ChunkMasks cand{std::vector<uint64_t>(v, 0), std::vector<uint64_t>(v, 0)};
    const double hi = static_cast<double>(threshold) * static_cast<double>(n);
    const double lo = (1.0 - static_cast<double>(threshold)) * static_cast<double>(n);
    for (int j = 0; j < v; ++j) {
      for (int t = 0; t < w; ++t) {
        const double c = static_cast<double>(chunk_bit_ones(ones, row_bytes, w, j, t));
        if (c > hi) {
          cand.mask[j] |= uint64_t{1} << t;
          cand.bitval[j] |= uint64_t{1} << t;
        } else if (c < lo) {
          cand.mask[j] |= uint64_t{1} << t;
        }
      }
    }
    // Realised net saving: per row, saved bits minus the one-bit-per-chunk header, rows with a
    // positive net only (the paper's scoring; padding ignored).
    std::vector<int64_t> mask_bits(v);
    for (int j = 0; j < v; ++j) mask_bits[j] = popcount64(cand.mask[j]);
    int64_t net = 0;
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* row = sample.row(r);
      int64_t saved = 0;
      for (int j = 0; j < v; ++j) {
        const bool participates =
            (load_chunk_any(row, row_bytes, w, j) & cand.mask[j]) == cand.bitval[j];
        saved += participates ? mask_bits[j] : 0;
      }
      if (saved > v) net += saved - v;
    }
    if (net > best_net) {
      best_net = net;
      best = std::move(cand);
    }
  }
  return best;
}

}  // namespace

// The codebook fit of format.h's C > 1 (docs/codec.md states it; reference.py mirrors it). Per
// position, the s best-ranked bits (s <= kMaxCodebookMaskBits) become the mask, s chosen to
// minimise (W - s) * n + s * (rows outside the K most frequent patterns), ties to the smallest s;
// the codebook is those K patterns, most frequent first (ties: smaller pattern first), padded
// with the first one when fewer occur.
//
// NOTE(codec): the pattern counts of every prefix come from one pass. Each row's chunk becomes a
// 16-bit key holding its best-ranked bits from the top down, so the patterns of the s best bits
// are the key's top s bits: level s of a histogram is level s + 1 with neighbouring bins summed,
// and in sorted keys they are runs.
//
// One result per entry of code_bits (each in [2, kMaxCodeBits]): the ranking and the pattern
// histogram of a position do not depend on C, only the choice of s and the codebook do.
std::vector<ChunkMasks> fit_codebook_widths(const SampleRows& sample, int w,
                                            const std::vector<int>& code_bits) {
  static_assert(kMaxCodebookMaskBits == 16, "keys are 16-bit");
  const int64_t n = std::min(sample.num_rows, kCodebookFitRows);
  const int v = chunks_per_row(sample.width, w);
  const int max_s = std::min(w, kMaxCodebookMaskBits);
  std::vector<ChunkMasks> out;
  for (const int c : code_bits) {
    out.push_back(ChunkMasks{std::vector<uint64_t>(v, 0),
                             std::vector<uint64_t>(static_cast<size_t>(v) * codebook_size(c), 0)});
  }
  // Small samples sort their keys (runs of equal prefixes are the patterns); large ones use a
  // histogram, whose 2^16 bins would dominate for a few thousand rows.
  const bool sorted_keys = n <= kSortedKeyRows;
  // levels[s] holds 2^s bins at offset 2^s - 1 (1 + 2 + ... + 2^16 bins in all).
  std::vector<int64_t> levels(sorted_keys ? 0 : (size_t{2} << max_s) - 1);
  const auto level = [&](int s) { return levels.data() + ((size_t{1} << s) - 1); };
  std::vector<uint32_t> keys(static_cast<size_t>(n));
  // (count, top-s key bits) of every pattern of the s best-ranked bits, in key order.
  std::vector<std::pair<int64_t, uint32_t>> runs;
  const auto patterns_of = [&](int s) {
    runs.clear();
    if (sorted_keys) {
      for (int64_t r = 0; r < n;) {
        int64_t e = r + 1;
        while (e < n && (keys[e] >> (max_s - s)) == (keys[r] >> (max_s - s))) ++e;
        runs.emplace_back(e - r, keys[r] >> (max_s - s));
        r = e;
      }
    } else {
      const int64_t* bins = level(s);
      for (uint32_t b = 0; b < (uint32_t{1} << s); ++b) {
        if (bins[b] != 0) runs.emplace_back(bins[b], b);
      }
    }
  };
  std::vector<int64_t> counts;
  std::array<std::array<uint32_t, 256>, 8> key_bits;  // [byte of the chunk][its value]
  for (int j = 0; j < v; ++j) {
    const std::array<uint8_t, 64> ranking = rank_bits_conditional(sample, w, j, max_s);
    // The key gathers bits ranking[0], ranking[1], ... from the top down: a bit permutation,
    // applied a byte of the chunk at a time through tables (one lookup per byte, not per bit).
    for (auto& table : key_bits) table.fill(0);
    for (int i = 0; i < max_s; ++i) {
      const int byte = ranking[i] / 8;
      const uint32_t key_bit = uint32_t{1} << (max_s - 1 - i);
      for (int value = 0; value < 256; ++value) {
        if ((value >> (ranking[i] % 8)) & 1) key_bits[byte][value] |= key_bit;
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const uint64_t x = load_chunk_any(sample.row(r), sample.width, w, j);
      uint32_t key = 0;
      for (int byte = 0; byte < w / 8; ++byte) key |= key_bits[byte][(x >> (8 * byte)) & 0xFF];
      keys[r] = key;
    }
    if (sorted_keys) {
      std::sort(keys.begin(), keys.end());
    } else {
      int64_t* hist = level(max_s);
      std::fill(hist, hist + (size_t{1} << max_s), 0);
      for (const uint32_t key : keys) ++hist[key];
      for (int s = max_s - 1; s >= 0; --s) {
        int64_t* dst = level(s);
        const int64_t* src = level(s + 1);
        for (size_t b = 0; b < (size_t{1} << s); ++b) dst[b] = src[2 * b] + src[2 * b + 1];
      }
    }
    std::vector<int> best_s(code_bits.size(), 0);
    std::vector<int64_t> best_cost(code_bits.size(), static_cast<int64_t>(w) * n);
    // NOTE(codec): the K most frequent patterns of s + 1 bits cover no more rows than those of
    // s bits (each refines one of them), so from covered(s) no longer prefix can cost less than
    // W n - max_s covered(s): once that reaches the best cost of every code width, the deeper,
    // costlier levels (2^s bins each) cannot change the choice and are not scanned.
    for (int s = 1; s <= max_s; ++s) {
      patterns_of(s);
      counts.clear();
      for (const auto& run : runs) counts.push_back(run.first);
      bool deeper_may_win = false;
      for (size_t ci = 0; ci < code_bits.size(); ++ci) {
        const int64_t covered = top_k_sum(counts.data(), static_cast<int64_t>(counts.size()),
                                          codebook_size(code_bits[ci]));
        const int64_t cost =
            static_cast<int64_t>(w - s) * n + static_cast<int64_t>(s) * (n - covered);
        if (cost < best_cost[ci]) {
          best_cost[ci] = cost;
          best_s[ci] = s;
        }
        deeper_may_win |=
            static_cast<int64_t>(w) * n - static_cast<int64_t>(max_s) * covered < best_cost[ci];
      }
      if (!deeper_may_win) break;
    }
    for (size_t ci = 0; ci < code_bits.size(); ++ci) {
      const int k = codebook_size(code_bits[ci]);
      const int bs = best_s[ci];
      uint64_t mask = 0;
      for (int i = 0; i < bs; ++i) mask |= uint64_t{1} << ranking[i];
      out[ci].mask[j] = mask;
      // (count, pattern) of every pattern of the chosen prefix, in the codebook's order.
      patterns_of(bs);
      std::vector<std::pair<int64_t, uint64_t>> patterns;
      for (const auto& [count, bits] : runs) {
        uint64_t pattern = 0;
        for (int i = 0; i < bs; ++i) {
          pattern |= static_cast<uint64_t>((bits >> (bs - 1 - i)) & 1) << ranking[i];
        }
        patterns.emplace_back(count, pattern);
      }
      std::sort(patterns.begin(), patterns.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      for (int i = 0; i < k && !patterns.empty(); ++i) {
        const size_t p = static_cast<size_t>(i) < patterns.size() ? static_cast<size_t>(i) : 0;
        out[ci].bitval[static_cast<size_t>(j) * k + i] = patterns[p].second;
      }
    }
  }
  return out;
}

ChunkMasks fit_masks(const SampleRows& sample, int chunk_bits, FitMethod method, int code_bits) {
  if (code_bits > 1) return fit_codebook_widths(sample, chunk_bits, {code_bits})[0];
  return method == FitMethod::kPaper ? fit_paper(sample, chunk_bits)
                                     : fit_greedy(sample, chunk_bits);
}

}  // namespace ibpembed
