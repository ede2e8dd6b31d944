// SPDX-License-Identifier: Apache-2.0
//
// Row kernels of one CPU path, templated on the bit-op policy. Included by exactly one .cpp per
// path (row_kernels_ref.cpp, row_kernels_bmi2.cpp, row_kernels_avx512.cpp); everything here sits
// in an anonymous namespace so the ISA-specific instantiations keep internal linkage and never
// leak into another path.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ibpembed/codec.h"
#include "ibpembed/row_codec.h"
#include "ibpembed/tier.h"

namespace ibpembed::detail {
namespace {

// NOTE(codec): a translation unit compiled with ISA flags must not emit weak template instances:
// the linker keeps one copy of each for the whole library, and it may be the copy compiled with
// -mavx512*, which a CPU without AVX-512 then runs. std::vector with the default allocator is
// such an instance (its fill and append loops get vectorised), so the row kernels' containers
// use an allocator of this unnamed namespace, which gives every instance internal linkage.
template <class T>
struct LocalAllocator {
  using value_type = T;
  LocalAllocator() = default;
  template <class U>
  constexpr LocalAllocator(const LocalAllocator<U>& /*other*/) noexcept {}
  T* allocate(size_t n) { return std::allocator<T>().allocate(n); }
  void deallocate(T* p, size_t n) { std::allocator<T>().deallocate(p, n); }
  friend bool operator==(const LocalAllocator&, const LocalAllocator&) { return true; }
  friend bool operator!=(const LocalAllocator&, const LocalAllocator&) { return false; }
};

template <class T>
using LocalVector = std::vector<T, LocalAllocator<T>>;

// NOTE(codec): the prefetch helpers must be always_inline. GCC's ipa-pure-const pass sees no
// side effect in __builtin_prefetch, marks an out-of-line helper whose body is only prefetches
// `const`, and then deletes every call to it: from a976f39 until this note, prefetch_index
// compiled to nothing (a conditional prefetch of a hot-row directory made it too big to be
// inlined early), and lookups ran 25-35 % slower. tests/codec/test_isa_objects.py checks they
// are there.
[[gnu::always_inline]] inline void prefetch_index(const TableView& t, int64_t r) {
  __builtin_prefetch(t.row_units + r, 0, 3);
  __builtin_prefetch(t.block_base + r / kRowsPerBlock, 0, 3);
  if (t.tier_dir != nullptr) __builtin_prefetch(t.tier_dir + 2 * (r >> 6), 0, 3);
}

// Lines into L2 (prefetcht1), for rows that likely come from the cache (decode_rows' NOTE): a
// round's lines are more than the L1 miss queue holds, and prefetcht0 measured slower side by
// side (a development microbenchmark).
[[gnu::always_inline]] inline void prefetch_lines(const uint8_t* begin, int64_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63};
  const auto end = reinterpret_cast<uintptr_t>(begin) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = first; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

template <int W>
LocalVector<uint8_t> free_counts(const uint64_t* mask, int num_chunks) {
  LocalVector<uint8_t> free(num_chunks);
  compute_free_bits<W>(mask, num_chunks, free.data());
  return free;
}

template <int W>
void size_rows_w(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                 const uint64_t* bitval, int code_bits, int64_t* comp_bytes) {
  const int v = chunks_per_row(row_bytes, W);
  const LocalVector<uint8_t> free = free_counts<W>(mask, v);
  for (int64_t r = 0; r < n; ++r) {
    comp_bytes[r] = compressed_row_bytes<W>(rows + r * row_bytes, row_bytes, mask, bitval,
                                            code_bits, free.data(), v);
  }
}

template <class Ops>
void size_rows(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
               const uint64_t* bitval, int chunk_bits, int code_bits, int64_t* comp_bytes) {
  switch (chunk_bits) {
    case 16: return size_rows_w<16>(rows, n, row_bytes, mask, bitval, code_bits, comp_bytes);
    case 32: return size_rows_w<32>(rows, n, row_bytes, mask, bitval, code_bits, comp_bytes);
    default: return size_rows_w<64>(rows, n, row_bytes, mask, bitval, code_bits, comp_bytes);
  }
}

template <int W, class Ops>
void encode_rows_w(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                   const uint64_t* bitval, int code_bits, const uint8_t* compressed,
                   const int64_t* offsets, uint8_t* payload) {
  const int v = chunks_per_row(row_bytes, W);
  const LocalVector<uint8_t> free = free_counts<W>(mask, v);
  // Encoding ORs bits into a zeroed scratch row with write slack, then copies only the encoded
  // bytes: neighbouring slots (possibly written by other threads) are never touched. A row is
  // only encoded when it shrinks, so its encoding is < row_bytes and the slack is >= 9 bytes.
  LocalVector<uint8_t> scratch(static_cast<size_t>(row_bytes) + 64);
  int64_t dirty = 0;  // scratch bytes the last encoding set; the rest are still zero
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* dst = payload + offsets[r];
    if (!compressed[r]) {
      std::memcpy(dst, row, static_cast<size_t>(row_bytes));
      continue;
    }
    std::memset(scratch.data(), 0, static_cast<size_t>(dirty));
    dirty =
        encode_row<W, Ops>(row, row_bytes, mask, bitval, code_bits, free.data(), v, scratch.data());
    std::memcpy(dst, scratch.data(), static_cast<size_t>(dirty));
  }
}

template <class Ops>
void encode_rows(const uint8_t* rows, int64_t n, int64_t row_bytes, const uint64_t* mask,
                 const uint64_t* bitval, int chunk_bits, int code_bits, const uint8_t* compressed,
                 const int64_t* offsets, uint8_t* payload) {
  switch (chunk_bits) {
    case 16:
      return encode_rows_w<16, Ops>(rows, n, row_bytes, mask, bitval, code_bits, compressed,
                                    offsets, payload);
    case 32:
      return encode_rows_w<32, Ops>(rows, n, row_bytes, mask, bitval, code_bits, compressed,
                                    offsets, payload);
    default:
      return encode_rows_w<64, Ops>(rows, n, row_bytes, mask, bitval, code_bits, compressed,
                                    offsets, payload);
  }
}

// Valid bits of one unaligned 8-byte stream read at the worst bit shift (7).
inline constexpr int kOneLoadBits = 57;

// Per-table constants of the decode loops, computed once per decode_rows call.
//
// NOTE(codec): free fields of consecutive chunks are adjacent in the stream, and pdep fills a
// mask's set bits in order, so one pdep with the concatenated free masks of the chunks of an
// 8-byte group decodes all of them at once. Every width then decodes 8 bytes per step.

template <int W>
struct DecodePlan {
  static constexpr int kChunksPerGroup = 64 / W;
  using Chunk =
      std::conditional_t<W == 16, uint16_t, std::conditional_t<W == 32, uint32_t, uint64_t>>;

  int code_bits;
  LocalVector<uint64_t> mask;
  LocalVector<uint8_t> free_count;        // k_j
  LocalVector<uint64_t> group_free_mask;  // concatenated ~mask of the group's chunks
  LocalVector<uint64_t> group_bitval;     // C = 1: concatenated patterns of the group's chunks
  LocalVector<Chunk> codebook;            // C > 1: [(j << C) | code], 0 for the escape code
  LocalVector<uint32_t> group_offset;     // stream bit of the group's first free field
  // group_free_mask as runs of set bits, for paths without pdep: group g deposits its free bits
  // as the OR over k in [run_begin[g], run_begin[g + 1]) of (bits << run_shift[k]) & run_mask[k].
  LocalVector<uint32_t> run_begin;
  LocalVector<uint8_t> run_shift;
  LocalVector<uint64_t> run_mask;
  LocalVector<uint32_t> field_offset;  // F_j = V * C + sum_{i<j} k_i
  uint64_t exception_start;            // E = V * C + sum_j k_j
  // Every group's free bits fit the 57 bits one unaligned 8-byte load holds at any bit shift
  // (true when each 8 bytes keep >= 7 invariant bits), so no group needs a 9th byte.
  bool groups_fit_one_load = true;

  explicit DecodePlan(const TableView& t)
      : code_bits(t.code_bits),
        mask(t.mask, t.mask + t.num_chunks),
        free_count(t.num_chunks),
        field_offset(t.num_chunks) {
    uint64_t pos = static_cast<uint64_t>(t.num_chunks) * static_cast<uint64_t>(code_bits);
    for (int j = 0; j < t.num_chunks; ++j) {
      free_count[j] = static_cast<uint8_t>(popcount64(~mask[j] & low_bits(W)));
      field_offset[j] = static_cast<uint32_t>(pos);
      pos += free_count[j];
    }
    exception_start = pos;
    const int k = codebook_size(code_bits);
    if (code_bits > 1) {
      codebook.assign(static_cast<size_t>(t.num_chunks) << code_bits, 0);
      for (int j = 0; j < t.num_chunks; ++j) {
        for (int code = 1; code <= k; ++code) {
          codebook[(static_cast<size_t>(j) << code_bits) | code] =
              static_cast<Chunk>(t.bitval[static_cast<int64_t>(j) * k + code - 1]);
        }
      }
    }
    const int groups = static_cast<int>(t.row_bytes / 8);
    group_free_mask.assign(groups, 0);
    group_bitval.assign(groups, 0);
    group_offset.resize(groups);
    for (int g = 0; g < groups; ++g) {
      const int first = g * kChunksPerGroup;
      group_offset[g] = field_offset[first];
      for (int c = 0; c < kChunksPerGroup; ++c) {
        const int shift = c * W;
        group_free_mask[g] |= (~mask[first + c] & low_bits(W)) << shift;
        if (code_bits == 1) group_bitval[g] |= t.bitval[first + c] << shift;
      }
      groups_fit_one_load &= popcount64(group_free_mask[g]) <= kOneLoadBits;
    }
    run_begin.assign(1, 0);
    for (int g = 0; g < groups; ++g) {
      int filled = 0;  // source bits the group's earlier runs take
      for (uint64_t rest = group_free_mask[g]; rest != 0;) {
        const int p = ctz64(rest);
        const int len = run_length(rest >> p);
        const uint64_t run = low_bits(len) << p;
        run_shift.push_back(static_cast<uint8_t>(p - filled));  // a run never starts below
        run_mask.push_back(run);                                // the bits before it
        filled += len;
        rest &= ~run;
      }
      run_begin.push_back(static_cast<uint32_t>(run_mask.size()));
    }
  }
};

// The decode loops' view of a DecodePlan: its arrays as plain pointers, held by value on the
// decoding call's stack.
//
// NOTE(codec): a cached DecodePlan lives on the heap (DecoderCache), and every byte a decode loop
// stores into a row may, as far as the compiler knows, alias the plan's vector members, so it
// reloaded their pointers after each 8-byte store: C = 1 rows decoded 1.25x slower than from a
// plan on the stack (development measurement, D = 128 W = 64). A view on the stack whose address
// never escapes keeps them in registers.
template <int W>
struct PlanView {
  using Chunk = typename DecodePlan<W>::Chunk;

  int code_bits;
  int groups;
  bool groups_fit_one_load;
  uint64_t exception_start;
  const uint64_t* mask;
  const uint8_t* free_count;
  const uint64_t* group_free_mask;
  const uint64_t* group_bitval;
  const Chunk* codebook;
  const uint32_t* group_offset;
  const uint32_t* run_begin;
  const uint8_t* run_shift;
  const uint64_t* run_mask;
  const uint32_t* field_offset;

  explicit PlanView(const DecodePlan<W>& p)
      : code_bits(p.code_bits),
        groups(static_cast<int>(p.group_offset.size())),
        groups_fit_one_load(p.groups_fit_one_load),
        exception_start(p.exception_start),
        mask(p.mask.data()),
        free_count(p.free_count.data()),
        group_free_mask(p.group_free_mask.data()),
        group_bitval(p.group_bitval.data()),
        codebook(p.codebook.data()),
        group_offset(p.group_offset.data()),
        run_begin(p.run_begin.data()),
        run_shift(p.run_shift.data()),
        run_mask(p.run_mask.data()),
        field_offset(p.field_offset.data()) {}
};

template <int W, class Ops>
uint64_t read_group_free(const PlanView<W>& plan, const uint8_t* in, int g) {
  const uint64_t bits = plan.groups_fit_one_load
                            ? read_stream_bits<kOneLoadBits>(in, plan.group_offset[g])
                            : read_stream_bits<64>(in, plan.group_offset[g]);
  if constexpr (Ops::kHardwareDeposit) {
    return Ops::deposit(bits, plan.group_free_mask[g]);
  } else {
    uint64_t out = 0;
    for (uint32_t k = plan.run_begin[g]; k < plan.run_begin[g + 1]; ++k) {
      out |= (bits << plan.run_shift[k]) & plan.run_mask[k];
    }
    return out;
  }
}

// C = 1. Two passes over a compressed row. Every chunk from its free field, a whole 8-byte group
// per pdep at a constant offset: no dependency between groups. Then the exceptions: walk the
// clear code bits (usually few) and patch those chunks in place. Returns the stream bit where the
// row's encoding ends (after its last exception), which the caller checks against the slot.
template <int W, class Ops>
uint64_t decode_ibp_row(const PlanView<W>& plan, const TableView& t, const uint8_t* in,
                        uint8_t* row) {
  const int groups = plan.groups;
  for (int g = 0; g < groups; ++g) {
    const uint64_t x = plan.group_bitval[g] | read_group_free<W, Ops>(plan, in, g);
    std::memcpy(row + 8 * static_cast<int64_t>(g), &x, 8);
  }
  // Chunks past the last whole group (rows whose width is not a multiple of 8 bytes).
  for (int j = groups * DecodePlan<W>::kChunksPerGroup; j < t.num_chunks; ++j) {
    const uint64_t free_mask = ~plan.mask[j] & low_bits(W);
    store_chunk<W>(
        row, t.row_bytes, j,
        decode_field<Ops>(read_stream_bits<W>(in, plan.field_offset[j]), free_mask, t.bitval[j]));
  }
  uint64_t pos = plan.exception_start;
  for (int base = 0; base < t.num_chunks; base += 64) {
    uint64_t codes;
    std::memcpy(&codes, in + base / 8, 8);
    const int valid = t.num_chunks - base < 64 ? t.num_chunks - base : 64;
    uint64_t escaped = ~codes & low_bits(valid);  // bits past V belong to the stream
    while (escaped != 0) {
      const int j = base + __builtin_ctzll(escaped);
      escaped &= escaped - 1;
      const uint64_t x = patch_exception<Ops>(load_chunk<W>(row, t.row_bytes, j),
                                              read_stream_bits<W>(in, pos), plan.mask[j]);
      store_chunk<W>(row, t.row_bytes, j, x);
      pos += W - plan.free_count[j];
    }
  }
  return pos;
}

// C > 1 (exponent-aware codes). Like decode_ibp_row, but every chunk first takes the codebook
// pattern of its own code, and the escaped chunks are listed on the way (branch-free) for the
// patch pass. `escapes` holds V entries. Returns the stream bit where the encoding ends.
template <int W, class Ops>
uint64_t decode_coded_row(const PlanView<W>& plan, const TableView& t, const uint8_t* in,
                          uint8_t* row, int32_t* escapes) {
  constexpr int kPerGroup = DecodePlan<W>::kChunksPerGroup;
  using Chunk = typename DecodePlan<W>::Chunk;
  const int c = plan.code_bits;
  const uint64_t code_mask = low_bits(c);
  const Chunk* codebook = plan.codebook;
  const int groups = plan.groups;
  int num_escapes = 0;
  // Pass 1: each chunk's pattern straight into the row, escapes listed; codes are read 56 bits
  // at a time (one load holds them at any bit shift). Pass 2 ORs in the free bits a whole 8-byte
  // group at a time, as decode_ibp_row does.
  const int whole = groups * kPerGroup;
  const int codes_per_read = 56 / c;
  Chunk* chunks = reinterpret_cast<Chunk*>(row);
  for (int j = 0; j < whole;) {
    uint64_t codes = read_stream_bits<kOneLoadBits>(in, static_cast<uint64_t>(j) * c);
    const int end = j + codes_per_read < whole ? j + codes_per_read : whole;
    for (; j < end; ++j, codes >>= c) {
      const uint64_t code = codes & code_mask;
      const Chunk pattern = codebook[(static_cast<size_t>(j) << c) | code];
      std::memcpy(chunks + j, &pattern, sizeof(Chunk));
      escapes[num_escapes] = j;
      num_escapes += code == 0;
    }
  }
  for (int g = 0; g < groups; ++g) {
    uint64_t x;
    std::memcpy(&x, row + 8 * static_cast<int64_t>(g), 8);
    x |= read_group_free<W, Ops>(plan, in, g);
    std::memcpy(row + 8 * static_cast<int64_t>(g), &x, 8);
  }
  for (int j = groups * kPerGroup; j < t.num_chunks; ++j) {
    const uint64_t code = static_cast<uint64_t>(read_code(in, j, c));
    const uint64_t free_mask = ~plan.mask[j] & low_bits(W);
    store_chunk<W>(row, t.row_bytes, j,
                   decode_field<Ops>(read_stream_bits<W>(in, plan.field_offset[j]), free_mask,
                                     codebook[(static_cast<size_t>(j) << c) | code]));
    escapes[num_escapes] = j;
    num_escapes += code == 0;
  }
  uint64_t pos = plan.exception_start;
  for (int e = 0; e < num_escapes; ++e) {
    const int j = escapes[e];
    const uint64_t x = patch_exception<Ops>(load_chunk<W>(row, t.row_bytes, j),
                                            read_stream_bits<W>(in, pos), plan.mask[j]);
    store_chunk<W>(row, t.row_bytes, j, x);
    pos += W - plan.free_count[j];
  }
  return pos;
}

// The scalar row decoder of a path: plain IBP (C = 1) or codebooks (C > 1). Built from a
// table's metadata (DecoderCache); decodes rows of any table with the same metadata.
template <int W, class Ops>
class ScalarRowDecoder {
 public:
  explicit ScalarRowDecoder(const TableView& t)
      : plan_(t), escapes_(t.code_bits > 1 ? static_cast<size_t>(t.num_chunks) : 0) {}

  // What a decode_rows call holds by value (see PlanView).
  class Bound {
   public:
    Bound(const DecodePlan<W>& plan, int32_t* escapes) : plan_(plan), escapes_(escapes) {}

    // `in` holds the slot followed by readable bytes up to max_encoding_bytes(t) +
    // kStageSlack. Returns the stream bit where the row's encoding ends.
    uint64_t operator()(const TableView& t, const uint8_t* in, uint8_t* row) const {
      if (plan_.code_bits == 1) return decode_ibp_row<W, Ops>(plan_, t, in, row);
      return decode_coded_row<W, Ops>(plan_, t, in, row, escapes_);
    }

   private:
    PlanView<W> plan_;
    int32_t* escapes_;
  };

  Bound bind() { return Bound(plan_, escapes_.data()); }

 private:
  DecodePlan<W> plan_;
  LocalVector<int32_t> escapes_;
};

// NOTE(codec): a row decoder's per-table constants (DecodePlan, the vector decoder's tables)
// cost 2-5 us to build, as much as decoding 10-40 rows, and a lookup request reads each of its
// tables in one small call. So each thread keeps the decoders of the tables it decoded last. A
// decoder depends on the table's metadata only (widths, masks, codebooks), and an entry is used
// only while those bytes equal the ones it was built from: a reload may free a table and reuse
// its addresses, so the pointers merely find the entry and the bytes decide.
template <class RowDecoder>
class DecoderCache {
 public:
  DecoderCache() { entries_.reserve(kCapacity); }

  RowDecoder& get(const TableView& t) {
    ++clock_;
    for (Entry& e : entries_) {
      if (e.matches(t)) {
        e.last_use = clock_;
        return *e.decoder;
      }
    }
    // Built aside first: if it throws (out of memory), the cache is as it was, with no entry
    // that matches and holds no decoder.
    Entry fresh;
    fresh.build(t);
    fresh.last_use = clock_;
    // Least recently used out, until the newcomer fits both bounds.
    const size_t bytes = fresh.metadata.size() * sizeof(uint64_t);
    while (!entries_.empty() &&
           (entries_.size() >= kCapacity || metadata_bytes_ + bytes > kMetadataBudget)) {
      auto oldest =
          std::min_element(entries_.begin(), entries_.end(),
                           [](const Entry& a, const Entry& b) { return a.last_use < b.last_use; });
      metadata_bytes_ -= oldest->metadata.size() * sizeof(uint64_t);
      std::swap(*oldest, entries_.back());
      entries_.pop_back();
    }
    entries_.push_back(std::move(fresh));  // within the reserved capacity: no reallocation
    metadata_bytes_ += bytes;
    return *entries_.back().decoder;
  }

 private:
  // Tables a thread keeps decoders for (a DCNv2-profile request reads 26), and the metadata
  // bytes their copies may hold: decoders take a few times their metadata, so wide rows (a D =
  // 4096 fp32 table with C = 4 codebooks has 0.5 MiB of it) keep fewer.
  static constexpr size_t kCapacity = 64;
  static constexpr size_t kMetadataBudget = size_t{4} << 20;

  struct Entry {
    int chunk_bits = 0;
    int num_chunks = 0;
    int code_bits = 0;
    int64_t row_bytes = 0;
    const uint64_t* mask = nullptr;
    const uint64_t* bitval = nullptr;
    LocalVector<uint64_t> metadata;  // the mask, then the codebooks, as built from
    std::unique_ptr<RowDecoder> decoder;
    uint64_t last_use = 0;

    static size_t bitval_words(const TableView& t) {
      return static_cast<size_t>(t.num_chunks) * static_cast<size_t>(codebook_size(t.code_bits));
    }

    bool matches(const TableView& t) const {
      return t.mask == mask && t.bitval == bitval && t.num_chunks == num_chunks &&
             t.code_bits == code_bits && t.chunk_bits == chunk_bits && t.row_bytes == row_bytes &&
             std::memcmp(metadata.data(), t.mask, sizeof(uint64_t) * num_chunks) == 0 &&
             std::memcmp(metadata.data() + num_chunks, t.bitval,
                         sizeof(uint64_t) * bitval_words(t)) == 0;
    }

    void build(const TableView& t) {
      chunk_bits = t.chunk_bits;
      num_chunks = t.num_chunks;
      code_bits = t.code_bits;
      row_bytes = t.row_bytes;
      mask = t.mask;
      bitval = t.bitval;
      metadata.assign(t.mask, t.mask + t.num_chunks);
      metadata.insert(metadata.end(), t.bitval, t.bitval + bitval_words(t));
      decoder = std::make_unique<RowDecoder>(t);
    }
  };

  LocalVector<Entry> entries_;
  size_t metadata_bytes_ = 0;
  uint64_t clock_ = 0;
};

// This thread's decoder for table t (see DecoderCache).
template <class RowDecoder>
RowDecoder& cached_decoder(const TableView& t) {
  thread_local DecoderCache<RowDecoder> cache;
  return cache.get(t);
}

// Readable bytes a decoder needs past the encoding it reads: the payload's own padding guarantee
// (kPayloadPad) is enough for the scalar decoders; vector decoders load whole 64-byte windows.
inline constexpr int64_t kStageSlack = 64;

// The most bytes a decoder reads of a compressed row, whatever its codes say: every chunk
// escaped, V * (C + W) bits. A row is decoded only where this much (plus kStageSlack) is readable
// after its slot's start, in the payload or in a stage, so a corrupted slot whose codes claim more
// exceptions than it holds is read within bounds and then rejected, never read past.
inline int64_t max_encoding_bytes(const TableView& t) {
  return (static_cast<int64_t>(t.num_chunks) * (t.code_bits + t.chunk_bits) + 7) / 8;
}

// Where a row's slot is and how to read it; resolved once per row, a round before it is read.
struct LocatedRow {
  const uint8_t* src;
  int64_t read_bytes;  // compressed: the slot plus kPayloadPad; raw: the row
  bool compressed;
  bool staged;         // compressed and copied into the round's stage, decoded from there
  uint8_t* decode_to;  // compressed: the repeat-cache slot it fills, or null (round scratch)
};

// This thread's stage for decode_rows (`bytes` of it), kept for its next calls: a lookup request
// reads each of its tables in one small call.
inline uint8_t* thread_stage(int64_t bytes) {
  thread_local LocalVector<uint8_t> stage;
  if (static_cast<int64_t>(stage.size()) < bytes) stage.resize(static_cast<size_t>(bytes));
  return stage.data();
}

// NOTE(codec): rows move through a pipeline of rounds of S = kDecodeStageRows rows: index entries
// are prefetched two rounds ahead and a row is located (its index read) one round ahead. On a
// table larger than the last-level cache (stage_min_bytes), a round then starts by copying its
// compressed slots into an L1 stage, one tight loop of independent loads, before it decodes them
// there. The decode loop issues hundreds of instructions per row, so out-of-order execution
// cannot see the next row's loads, and a slot read from DRAM in place missed line after line.
// Prefetching the slots a round ahead did not fix that: a software prefetch holds an L1 fill
// buffer until its line arrives (~320 ns from DRAM on the Intel Xeon VM), nine lines a row kept
// them all busy, and the decoder's own misses queued behind them. The copy loop instead keeps
// many lines in flight and lets the L2 streamer fetch a slot's later lines. Cold compressed
// lookups (2 GiB fp32, uniform ids, benchmarks.cpu_engine) take 200-215 ns staged against
// 330-370 prefetched; Zipf 1.05 lookups, whose rows are mostly cached, take the same either way.
// Raw rows are read where they lie, without a prefetch either: 105-119 ns against 120-135.
//
// Smaller tables, and rows whose id follows the previous id, keep the prefetches: their lines
// come from the cache, or stream in as a run's adjacent slots do, and each row is decoded where
// it lies. Staged, a table of 50 MiB (in L3) ran 20 % slower and one of 256 MiB 7 % slower,
// against 10 % faster at 1 GiB (uniform ids); whole-table decodes ran 20 % (D = 128 fp32) and
// 35 % (D = 16) slower with every slot copied (development A/B, alternating builds).
//
// NOTE(codec): a decoder may read up to `stride` bytes from a slot's start whatever its codes say
// (max_encoding_bytes plus the vector decoders' window slack), so a slot is decoded in place only
// when that much lies inside the payload after it; the stage gives every other slot that much.
template <class RowDecoder>
void decode_rows_with(const TableView& t, const int64_t* ids, int64_t n, uint8_t* out,
                      const RowSink* sink) {
  constexpr int64_t S = kDecodeStageRows;
  // A reference to the cached vector decoder; the scalar one binds a PlanView by value.
  const auto& decode_row = cached_decoder<RowDecoder>(t).bind();
  const int64_t raw_units = units_for(t.row_bytes, t.unit_bytes);
  const int64_t slot_cap = t.unit_bytes * raw_units;
  const int64_t stride = std::max(slot_cap, max_encoding_bytes(t)) + kStageSlack;
  const int64_t payload_end = t.block_base[num_blocks(t.num_rows)];
  const bool from_dram = payload_end > stage_min_bytes();
  uint8_t* stage = nullptr;  // this thread's, taken by the first staged row
  LocatedRow ring[2 * S];    // row i at i % 2S: this round's rows and the next round's
  // Staged rows among this round's and the next round's: a pooled call walks a round's rows
  // before decoding them only when some need the stage (most calls on cached tables have none).
  // Skipping the walk made pooled lookups of cached raw rows 4-10 % faster (development A/B).
  int staged_rows[2] = {0, 0};
  const uint8_t* rows[S];
  RepeatCache* repeats = sink != nullptr ? sink->repeats : nullptr;
  int64_t repeat_hits = 0;
  int64_t repeat_takes = 0;
  // Inlined: one call per row, and GCC outlines it once it grows past its inlining budget.
  const auto locate = [&](int64_t i) __attribute__((always_inline)) {
    const int64_t r = ids[i];
    const int64_t round = i / S;
    LocatedRow& loc = ring[i % (2 * S)];
    // Only compressed rows outside the tier take a slot, so a slot holding the row needs no
    // index lookup.
    const size_t index = repeats != nullptr ? repeats->slot(r) : 0;
    RepeatCache::Slot* const slot = repeats != nullptr ? &repeats->slots[index] : nullptr;
    if (slot != nullptr && slot->row == r) {  // an earlier row decodes it: read that
      slot->round = round;
      ++repeat_hits;
      loc = LocatedRow{repeats->row_of(index), t.row_bytes, false, false, nullptr};
      prefetch_lines(loc.src, t.row_bytes);
      return;
    }
    if (t.tier_rows != nullptr) {
      const int64_t tier = tier_slot(t, r);
      if (tier >= 0) {  // read like a raw row
        const uint8_t* copy = t.tier_rows + tier * t.tier_stride;
        loc = LocatedRow{copy, t.row_bytes, false, false, nullptr};
        prefetch_lines(copy, t.row_bytes);
        return;
      }
      if (tier == kBadTierSlot) throw_corrupt_table(r, kBadTierSlotWhat);
    }
    const int64_t offset = row_offset(t, r);
    const int64_t units = t.row_units[r];
    // NOTE(codec): format.h: a row is compressed iff its slot is smaller than a raw one, so the
    // slot size says it and the CPU never reads the bitmask (the GPU kernels keep theirs on the
    // device). One line fewer per row: raw-row lookups 7-9 % and compressed 3-7 % faster
    // (development A/B, 1 GiB table, Zipf ids). A slot larger than a raw one, or outside the
    // payload, would read past the stage or the payload. The bounds are compared as
    // `offset > end - bytes`: a corrupt block base near 2^63 would wrap `offset + bytes` back
    // into range.
    loc.compressed = units < raw_units;
    if (units > raw_units || offset < 0 || offset > payload_end - units * t.unit_bytes) {
      throw_corrupt_table(r,
                          "the index gives it a slot outside the payload or larger than a raw "
                          "row's");
    }
    loc.src = t.payload + offset;
    loc.read_bytes = loc.compressed ? t.unit_bytes * units + kPayloadPad : t.row_bytes;
    const bool prefetched = !from_dram || (i > 0 && ids[i - 1] == r - 1);
    loc.staged = loc.compressed && !(prefetched && offset <= payload_end - stride);
    staged_rows[round & 1] += loc.staged;
    if (prefetched) prefetch_lines(loc.src, loc.read_bytes);
    loc.decode_to = nullptr;
    if (loc.compressed && slot != nullptr && slot->round < round) {
      // No row of this round reads the slot: take it.
      *slot = RepeatCache::Slot{r, round};
      ++repeat_takes;
      loc.decode_to = repeats->row_of(index);
    }
  };
  for (int64_t i = 0; i < 2 * S && i < n; ++i) prefetch_index(t, ids[i]);
  for (int64_t i = 0; i < S && i < n; ++i) locate(i);
  for (int64_t begin = 0; begin < n; begin += S) {
    const int64_t end = begin + S < n ? begin + S : n;
    const int64_t parity = (begin / S) & 1;
    // The test sits in the loop header on purpose: the same test as an `if` around the loop
    // compiled to code that ran lookups of cached compressed rows 15-25 % slower (development
    // A/B, GCC 12).
    for (int64_t i = begin; i < end && (sink == nullptr || staged_rows[parity] != 0); ++i) {
      const LocatedRow& loc = ring[i % (2 * S)];
      if (loc.staged) {
        if (stage == nullptr) stage = thread_stage(S * stride);
        std::memcpy(stage + (i - begin) * stride, loc.src, static_cast<size_t>(loc.read_bytes));
      } else if (!loc.compressed && sink == nullptr) {
        std::memcpy(out + i * t.row_bytes, loc.src, static_cast<size_t>(t.row_bytes));
      }
    }
    staged_rows[parity] = 0;  // its entries take the round after next
    for (int64_t i = begin; i < end; ++i) {
      const LocatedRow loc = ring[i % (2 * S)];
      if (i + 2 * S < n) prefetch_index(t, ids[i + 2 * S]);
      if (i + S < n) locate(i + S);
      if (loc.compressed) {
        uint8_t* row = loc.decode_to != nullptr
                           ? loc.decode_to
                           : out + (sink == nullptr ? i : i - begin) * t.row_bytes;
        const uint8_t* in = loc.staged ? stage + (i - begin) * stride : loc.src;
        const uint64_t end_bit = decode_row(t, in, row);
        if (end_bit > static_cast<uint64_t>(8 * (loc.read_bytes - kPayloadPad))) {
          throw_corrupt_table(ids[i], "its codes ask for more bits than its slot holds");
        }
        rows[i - begin] = row;
      } else {
        rows[i - begin] = loc.src;
      }
    }
    if (sink != nullptr) sink->consume(sink->ctx, begin, end - begin, rows);
    if (repeats != nullptr && !repeats->pays(repeat_hits, repeat_takes)) {
      repeats = nullptr;  // rows already pointed at slots still find them decoded
    }
  }
}

template <class Ops>
void decode_rows(const TableView& t, const int64_t* ids, int64_t n, uint8_t* out,
                 const RowSink* sink) {
  switch (t.chunk_bits) {
    case 16: return decode_rows_with<ScalarRowDecoder<16, Ops>>(t, ids, n, out, sink);
    case 32: return decode_rows_with<ScalarRowDecoder<32, Ops>>(t, ids, n, out, sink);
    default: return decode_rows_with<ScalarRowDecoder<64, Ops>>(t, ids, n, out, sink);
  }
}

template <class Ops>
RowKernels make_row_kernels() {
  return RowKernels{&size_rows<Ops>, &encode_rows<Ops>, &decode_rows<Ops>};
}

}  // namespace
}  // namespace ibpembed::detail
