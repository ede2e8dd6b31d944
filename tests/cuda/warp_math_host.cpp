// SPDX-License-Identifier: Apache-2.0
//
// Host emulation of the CUDA kernels' warp-level index math. Compiled by g++ (test_warp_math.py)
// against csrc/cuda/warp_decode.cuh, the very lane functions the kernels call; a loop over 32
// lanes stands in for each warp collective (__shfl_up_sync scan, __reduce_add_sync, __ballot_sync).
// Rows are encoded with the CPU codec (row_codec.h), for every code width C = 1..4 with random
// masks and codebooks, staged the way stage_row() stages them (16-byte window at an arbitrary
// payload offset) and decoded the way the kernels decode them; every word a lane reads is
// bounds-checked against the staging buffer the launch allocates.
// Prints "ok <cases>" and exits 0, or prints the first mismatch and exits 1.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../../csrc/cuda/warp_decode.cuh"
#include "ibpembed/row_codec.h"

namespace {

using namespace ibpembed;
using namespace ibpembed::gpu;

std::mt19937_64 rng(20261129);
int64_t cases = 0;
// Per code width: compressed rows decoded, and how often each code occurred in them.
int64_t compressed_cases[kMaxCodeBits + 1] = {};
int64_t code_counts[kMaxCodeBits + 1][1 << kMaxCodeBits] = {};

[[noreturn]] void fail(const char* what, long long a, long long b, long long c) {
  std::printf("FAIL %s (%lld, %lld, %lld)\n", what, a, b, c);
  std::exit(1);
}

uint64_t rand_bits(int w) { return rng() & low_bits(w); }

// Masks shaped like fitted ones: a few runs of invariant bits, sometimes all or none.
uint64_t rand_mask(int w) {
  switch (rng() % 6) {
    case 0: return 0;
    case 1: return low_bits(w);
    case 2: return rand_bits(w);
    default: {
      uint64_t m = 0;
      const int runs = 1 + static_cast<int>(rng() % 3);
      for (int r = 0; r < runs; ++r) {
        const int start = static_cast<int>(rng() % w);
        const int len = 1 + static_cast<int>(rng() % (w - start));
        m |= low_bits(len) << start;
      }
      return m & low_bits(w);
    }
  }
}

void test_deposit() {
  for (int i = 0; i < 200000; ++i) {
    const uint64_t mask = (i % 2) ? rand_mask(64) : rng();
    const uint64_t src = rng();
    if (deposit_runs(src, mask) != deposit_bits_portable(src, mask)) fail("deposit_runs", i, 0, 0);
    if (extract_runs(src, mask) != extract_bits_portable(src, mask)) fail("extract_runs", i, 0, 0);
    ++cases;
  }
}

// Sum over the 32 lanes of the terms __reduce_add_sync adds, against format.h's row_offset().
void test_row_offsets() {
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t unit = int64_t{1} << (rng() % 6);
    std::vector<uint8_t> units(num_blocks(rows) * kRowsPerBlock, 0);
    std::vector<int64_t> base(num_blocks(rows) + 1, 0);
    int64_t total = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (r % kRowsPerBlock == 0) base[r / kRowsPerBlock] = total;
      units[r] = static_cast<uint8_t>(rng() % 256);
      total += units[r] * unit;
    }
    base.back() = total;
    const TableView t{nullptr, base.data(), units.data(), nullptr, nullptr, nullptr,
                      rows,    1,           unit,         16,      1,       1};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r >> 5;
      const int in_block = static_cast<int>(r & 31);
      uint32_t before = 0;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        before += units_before_term(units[b * kRowsPerBlock + lane], lane, in_block);
      }
      if (base[b] + unit * before != row_offset(t, r)) fail("row offset", trial, r, before);
      ++cases;
    }
  }
}

// The staging buffer of one warp, filled like stage_row(): the slot's 16-byte window copied from
// the payload, and junk everywhere else (shared memory is never cleared).
struct Stage {
  std::vector<uint32_t> words;
  int shift = 0;
};

Stage stage_slot(const std::vector<uint8_t>& payload, int64_t offset, int64_t slot_bytes,
                 int64_t stage_bytes) {
  const Window w = stage_window(offset, slot_bytes);
  if (w.first % kVecBytes != 0 || w.shift < 0 || w.shift >= kVecBytes ||
      w.first + int64_t{kVecBytes} * w.vecs < offset + slot_bytes) {
    fail("window does not cover the slot", offset, slot_bytes, w.vecs);
  }
  // The kernel's stage_row() refuses windows that leave less than 32 bytes of read slack.
  if (int64_t{kVecBytes} * w.vecs + 2 * kVecBytes > stage_bytes) {
    fail("window too large for the stage buffer", offset, slot_bytes, stage_bytes);
  }
  Stage s;
  s.words.assign(static_cast<size_t>(stage_bytes / 4), 0xA5A5A5A5u);
  std::memcpy(s.words.data(), payload.data() + w.first, static_cast<size_t>(kVecBytes) * w.vecs);
  s.shift = w.shift;
  return s;
}

template <int W>
uint64_t checked_read(const Stage& s, uint64_t bitpos) {
  const uint64_t last_word = (bitpos >> 5) + (W > 32 ? 2 : 1);
  if (last_word >= s.words.size()) fail("read past the stage buffer", bitpos, W, s.words.size());
  return read_staged_bits<W>(s.words.data(), bitpos);
}

// exception_area_start() of row_pipeline.cuh: the warp's lane sums, reduced.
template <int W>
uint64_t emulate_exception_start(const uint64_t* mask, int v, int code_bits) {
  uint64_t sum = 0;
  for (int lane = 0; lane < kWarpSize; ++lane) sum += lane_free_bits_sum<W>(mask, lane, v);
  return free_fields_start(v, code_bits) + sum;
}

// decode_staged_row() of row_pipeline.cuh with the warp unrolled into a loop over lanes.
// codes[j] is the code the CPU encoder gave chunk j, to check each lane's view of its chunk.
template <int W>
std::vector<uint8_t> emulate_decode(const Stage& s, const uint64_t* mask, const uint64_t* bitval,
                                    int code_bits, const std::vector<int>& codes, int v,
                                    int64_t row_bytes, int64_t slot_bytes) {
  std::vector<uint8_t> row(static_cast<size_t>(row_bytes), 0);
  const int k = codebook_size(code_bits);
  const uint64_t slot_bits = 8 * static_cast<uint64_t>(slot_bytes);
  const uint64_t base = 8 * static_cast<uint64_t>(s.shift);
  uint64_t fbase = free_fields_start(v, code_bits);
  uint64_t ebase = emulate_exception_start<W>(mask, v, code_bits);
  if (fbase > slot_bits) fail("codes past the slot", code_bits, v, slot_bytes);
  for (int g = 0; 32 * g < v; ++g) {
    LaneChunk c[kWarpSize];
    int incl[kWarpSize];
    for (int lane = 0; lane < kWarpSize; ++lane) {
      const int j = 32 * g + lane;
      // Only lanes with a chunk read a code (lane_chunk() returns before the read otherwise).
      if (j < v) {
        checked_read<8>(s, base + static_cast<uint64_t>(j) * static_cast<uint64_t>(code_bits));
        if (staged_code(s.words.data(), s.shift, j, code_bits) != codes[j]) {
          fail("staged code", code_bits, j, codes[j]);
        }
      }
      c[lane] = lane_chunk<W>(s.words.data(), s.shift, mask, bitval, code_bits, g, lane, v);
      if (c[lane].valid != (j < v)) fail("lane validity", g, lane, v);
      if (c[lane].valid) {
        const uint64_t want =
            codes[j] != 0 ? bitval[static_cast<int64_t>(j) * k + codes[j] - 1] : 0;
        if (c[lane].participates != (codes[j] != 0) || c[lane].bitval != want) {
          fail("lane code", code_bits, j, codes[j]);
        }
      }
      // The __shfl_up_sync scan of the packed lengths.
      incl[lane] = pack_lengths(c[lane]) + (lane > 0 ? incl[lane - 1] : 0);
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
      const uint64_t field = fbase + static_cast<uint64_t>(packed_free(incl[lane]) - c[lane].free);
      const uint64_t exception =
          ebase + static_cast<uint64_t>(packed_exception(incl[lane]) - c[lane].exception);
      if (field + c[lane].free > slot_bits || exception + c[lane].exception > slot_bits) {
        fail("overrun", g, lane, static_cast<long long>(field));
      }
      checked_read<W>(s, base + field);
      checked_read<W>(s, base + exception);
      const uint64_t x = lane_decode<W>(s.words.data(), s.shift, field, exception, c[lane]);
      if (c[lane].valid) store_chunk<W>(row.data(), row_bytes, c[lane].j, x);
    }
    fbase += static_cast<uint64_t>(packed_free(incl[kWarpSize - 1]));
    ebase += static_cast<uint64_t>(packed_exception(incl[kWarpSize - 1]));
  }
  return row;
}

// A row whose chunks escape with probability `escape` (random masked bits, which may still match
// a pattern by chance) and otherwise take a uniformly drawn code 1..K; free bits are random.
template <int W>
std::vector<uint8_t> make_row(const uint64_t* mask, const uint64_t* bitval, int code_bits, int v,
                              int64_t row_bytes, double escape) {
  const int k = codebook_size(code_bits);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<uint8_t> row(static_cast<size_t>(row_bytes));
  for (int j = 0; j < v; ++j) {
    uint64_t x = rand_bits(W);
    if (unit(rng) >= escape) {
      const int code = 1 + static_cast<int>(rng() % k);
      x = bitval[static_cast<int64_t>(j) * k + code - 1] | (x & ~mask[j]);
    }
    store_chunk<W>(row.data(), row_bytes, j, x);
  }
  return row;
}

// Codebook of position j: K random patterns inside mask[j], sometimes with repeats (the encoder
// then takes the first, and a later copy is never used) or all equal.
template <int W>
void make_codebook(uint64_t mask, int k, uint64_t* patterns) {
  const int style = static_cast<int>(rng() % 4);
  for (int i = 0; i < k; ++i) {
    if (style == 0 && i > 0) {
      patterns[i] = patterns[0];
    } else if (style == 1 && i > 0 && (rng() & 1)) {
      patterns[i] = patterns[rng() % i];
    } else {
      patterns[i] = rng() & mask;
    }
  }
}

template <int W>
void test_rows(int64_t row_bytes, int code_bits) {
  const int v = chunks_per_row(row_bytes, W);
  const int kb = codebook_size(code_bits);
  if (code_bits_for(static_cast<int64_t>(v) * kb, v) != code_bits) {
    fail("code_bits_for", code_bits, v, kb);
  }
  for (int trial = 0; trial < 24; ++trial) {
    std::vector<uint64_t> mask(v), bitval(static_cast<size_t>(v) * kb);
    for (int j = 0; j < v; ++j) {
      mask[j] = rand_mask(W);
      make_codebook<W>(mask[j], kb, bitval.data() + static_cast<int64_t>(j) * kb);
    }
    // The padding bits past row_bytes are zero in every row, as the fit makes them invariant.
    const int64_t pad_from = row_bytes - static_cast<int64_t>(v - 1) * (W / 8);
    const uint64_t pad_mask = ~low_bits(static_cast<int>(8 * pad_from)) & low_bits(W);
    mask[v - 1] |= pad_mask;
    for (int i = 0; i < kb; ++i) bitval[static_cast<int64_t>(v - 1) * kb + i] &= ~pad_mask;
    for (int j = 0; j < v; ++j) {
      for (int i = 0; i < kb; ++i) {
        if ((bitval[static_cast<int64_t>(j) * kb + i] & ~mask[j]) != 0) {
          fail("codebook entry outside its mask", code_bits, j, i);
        }
      }
    }
    std::vector<uint8_t> free(v);
    compute_free_bits<W>(mask.data(), v, free.data());
    const int64_t unit = slot_unit_bytes(row_bytes, int64_t{1} << (rng() % 5));
    const int64_t stage_bytes = stage_buffer_bytes(row_bytes, unit);
    for (int k = 0; k < 8; ++k) {
      // Mostly matching rows (what gets stored compressed), some with many escapes.
      const double escape = k < 2 ? 0.0 : (k < 6 ? 0.1 : 0.5);
      const std::vector<uint8_t> row =
          make_row<W>(mask.data(), bitval.data(), code_bits, v, row_bytes, escape);
      const int64_t enc = compressed_row_bytes<W>(row.data(), row_bytes, mask.data(), bitval.data(),
                                                  code_bits, free.data(), v);
      // The payload the slot lives in: any unit-aligned offset, zero pad after it.
      const int64_t offset = unit * static_cast<int64_t>(rng() % 64);
      const int64_t raw_slot = unit * units_for(row_bytes, unit);
      const int64_t comp_slot = unit * units_for(enc, unit);
      std::vector<uint8_t> payload(static_cast<size_t>(offset + raw_slot + kPayloadPad + 16), 0);

      // Compressed slot (only when the format would store it compressed).
      if (comp_slot < raw_slot) {
        std::vector<uint8_t> code(static_cast<size_t>(enc + 9), 0);
        if (encode_row<W, PortableBitOps>(row.data(), row_bytes, mask.data(), bitval.data(),
                                          code_bits, free.data(), v, code.data()) != enc) {
          fail("encode_row size", W, row_bytes, v);
        }
        std::memcpy(payload.data() + offset, code.data(), static_cast<size_t>(enc));
        if (emulate_exception_start<W>(mask.data(), v, code_bits) !=
            exception_start(free.data(), v, code_bits)) {
          fail("exception area start", W, row_bytes, v);
        }
        std::vector<int> codes(v);
        for (int j = 0; j < v; ++j) {
          codes[j] = chunk_code(load_chunk<W>(row.data(), row_bytes, j), mask[j],
                                bitval.data() + static_cast<int64_t>(j) * kb, kb);
          if (read_code(code.data(), j, code_bits) != codes[j]) {
            fail("encoded code", code_bits, j, codes[j]);
          }
          ++code_counts[code_bits][codes[j]];
        }
        const Stage s = stage_slot(payload, offset, comp_slot, stage_bytes);
        const std::vector<uint8_t> got = emulate_decode<W>(s, mask.data(), bitval.data(), code_bits,
                                                           codes, v, row_bytes, comp_slot);
        if (got != row) fail("compressed row", W, row_bytes, offset);
        ++cases;
        ++compressed_cases[code_bits];
      }

      // Raw slot: the kernels' plain copy path (32-bit funnel reads) and the pooled kernel's
      // element reads straight from the staging buffer.
      std::fill(payload.begin(), payload.end(), 0);
      std::memcpy(payload.data() + offset, row.data(), static_cast<size_t>(row_bytes));
      const Stage s = stage_slot(payload, offset, raw_slot, stage_bytes);
      std::vector<uint8_t> copy(static_cast<size_t>(row_bytes));
      for (int64_t i = 0; 4 * i < row_bytes; ++i) {
        const auto word =
            static_cast<uint32_t>(checked_read<32>(s, 8 * static_cast<uint64_t>(s.shift + 4 * i)));
        for (int64_t b = 0; b < 4 && 4 * i + b < row_bytes; ++b) {
          copy[4 * i + b] = static_cast<uint8_t>(word >> (8 * b));
        }
      }
      if (copy != row) fail("raw copy", W, row_bytes, offset);
      for (int64_t e = 0; 2 * e + 2 <= row_bytes; ++e) {
        const uint64_t bit = 8 * static_cast<uint64_t>(s.shift) + 16 * static_cast<uint64_t>(e);
        const auto h = static_cast<uint16_t>(checked_read<16>(s, bit));
        uint16_t want;
        std::memcpy(&want, row.data() + 2 * e, 2);
        if (h != want) fail("raw 16-bit element", W, row_bytes, e);
      }
      for (int64_t e = 0; e < row_bytes; ++e) {
        const auto q = static_cast<uint8_t>(
            checked_read<8>(s, 8 * static_cast<uint64_t>(s.shift) + 8 * static_cast<uint64_t>(e)));
        if (q != row[e]) fail("raw byte", W, row_bytes, e);
      }
      ++cases;
    }
  }
}

// Every position of a sorted id list is written by exactly one run, whatever warp owns its head.
void test_runs() {
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 400);
    const int64_t distinct = 1 + static_cast<int64_t>(rng() % 50);
    std::vector<int64_t> ids(n);
    for (auto& id : ids) id = static_cast<int64_t>(rng() % distinct);
    std::sort(ids.begin(), ids.end());
    const int64_t* p = (trial % 10 == 0) ? nullptr : ids.data();
    std::vector<int> covered(n, 0);
    for (int64_t head = 0; head < n; ++head) {
      if (!is_run_head(p, head)) continue;
      int len = kWarpSize;  // the first lane whose ballot bit is clear
      for (int lane = 0; lane < kWarpSize; ++lane) {
        if (!lane_in_run(p, n, head, lane)) {
          len = lane;
          break;
        }
      }
      for (int lane = 0; lane < len; ++lane) {
        const int64_t pos = head + lane;
        if (pos >= n) fail("run past n", trial, head, lane);
        if (p != nullptr && ids[pos] != ids[head]) fail("run mixes ids", trial, head, lane);
        ++covered[pos];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (covered[i] != 1) fail("position not covered exactly once", trial, i, covered[i]);
    }
    ++cases;
  }
}

}  // namespace

int main() {
  test_deposit();
  test_row_offsets();
  test_runs();
  for (int code_bits = 1; code_bits <= kMaxCodeBits; ++code_bits) {
    for (const int64_t row_bytes : {1, 2, 3, 5, 8, 15, 16, 33, 64, 129, 258, 516, 1024, 2056}) {
      test_rows<16>(row_bytes, code_bits);
      test_rows<32>(row_bytes, code_bits);
      test_rows<64>(row_bytes, code_bits);
    }
  }
  // Every width must have decoded compressed rows using each of its codes, the escape included.
  for (int code_bits = 1; code_bits <= kMaxCodeBits; ++code_bits) {
    if (compressed_cases[code_bits] == 0) fail("no compressed rows", code_bits, 0, 0);
    for (int code = 0; code <= codebook_size(code_bits); ++code) {
      if (code_counts[code_bits][code] == 0) fail("code never decoded", code_bits, code, 0);
    }
  }
  std::printf("ok %lld\n", static_cast<long long>(cases));
  return 0;
}
