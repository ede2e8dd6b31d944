// SPDX-License-Identifier: Apache-2.0
//
// Bit primitives shared by the host codec and the device kernels. Each operation has one portable
// definition here (the scalar reference, also what the GPU runs); the BMI2 host path swaps in
// pext/pdep through the Ops policy of row_codec.h, never by #ifdef, so both paths are always built
// and can be compared byte for byte.
#pragma once

#include <cstdint>
#include <cstring>

#include "ibpembed/format.h"

namespace ibpembed {

IBP_HD int popcount64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#elif defined(__POPCNT__)
  return __builtin_popcountll(x);
#else
  // Without -mpopcnt the builtin is a libgcc call; the SWAR count is a dozen inline ops.
  x -= (x >> 1) & 0x5555555555555555ull;
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return static_cast<int>((x * 0x0101010101010101ull) >> 56);
#endif
}

IBP_HD int ctz64(uint64_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// Scatter the low popcount(mask) bits of src to the set positions of mask, lowest first: pdep,
// one bit at a time. The plain statement of the operation, which tests check the run-wise
// versions below against.
IBP_HD uint64_t deposit_bits_portable(uint64_t src, uint64_t mask) {
  uint64_t out = 0;
  for (uint64_t bit = 1; mask != 0; bit <<= 1) {
    const uint64_t lowest = mask & (~mask + 1);
    if (src & bit) out |= lowest;
    mask ^= lowest;
  }
  return out;
}

// Gather the bits of x at the set positions of mask into the low bits of the result: pext, one
// bit at a time (the statement, as above).
IBP_HD uint64_t extract_bits_portable(uint64_t x, uint64_t mask) {
  uint64_t out = 0;
  for (uint64_t bit = 1; mask != 0; bit <<= 1) {
    const uint64_t lowest = mask & (~mask + 1);
    if (x & lowest) out |= bit;
    mask ^= lowest;
  }
  return out;
}

// Length of the run of set bits of mask that starts at its lowest set bit p (t = mask >> p).
IBP_HD int run_length(uint64_t t) {
  return ~t == 0 ? 64 : ctz64(~t);  // ~t is zero only for an all-ones mask: one 64-bit run
}

// pdep without BMI2, one step per run of set bits in mask instead of one per bit. Fitted masks
// keep the sign/exponent MSBs and sometimes a few low mantissa bits invariant, so a chunk's free
// bits form one to three runs: a handful of shifts per chunk. What the GPU runs, and the CPU
// where pdep is missing (ARM, x86 before Haswell) or microcoded (AMD before Zen 3).
IBP_HD uint64_t deposit_runs(uint64_t src, uint64_t mask) {
  uint64_t out = 0;
  while (mask != 0) {
    const int p = ctz64(mask);
    const int len = run_length(mask >> p);
    const uint64_t run = low_bits(len);
    out |= (src & run) << p;
    src = len >= 64 ? 0 : src >> len;
    mask &= ~(run << p);
  }
  return out;
}

// pext without BMI2, run by run (as deposit_runs).
IBP_HD uint64_t extract_runs(uint64_t x, uint64_t mask) {
  uint64_t out = 0;
  int filled = 0;
  while (mask != 0) {
    const int p = ctz64(mask);
    const int len = run_length(mask >> p);
    const uint64_t run = low_bits(len);
    out |= ((x >> p) & run) << filled;  // filled + len <= 64: the runs hold popcount(mask) bits
    filled += len;
    mask &= ~(run << p);
  }
  return out;
}

// The bit-op policy of the portable paths: the scalar `ref` CPU path and the GPU kernels.
// Without a deposit instruction, row decoders precompute each per-table mask's runs instead.
struct PortableBitOps {
  static constexpr bool kHardwareDeposit = false;
  IBP_HD_METHOD static uint64_t deposit(uint64_t src, uint64_t mask) {
    return deposit_runs(src, mask);
  }
  IBP_HD_METHOD static uint64_t extract(uint64_t x, uint64_t mask) { return extract_runs(x, mask); }
};

// Read at least W valid bits of an LSB-first stream starting at bit `pos` (bits above W are
// garbage). Reads up to 9 bytes from byte pos / 8: callers guarantee that slack.
template <int W>
IBP_HD uint64_t read_stream_bits(const uint8_t* stream, uint64_t pos) {
  const uint8_t* p = stream + (pos >> 3);
  const int shift = static_cast<int>(pos & 7);
  uint64_t v;
  memcpy(&v, p, 8);
  v >>= shift;
  if constexpr (W == 64) {
    // A 64-bit field at a non-zero bit shift spills into a 9th byte. Written without a branch:
    // at shift 0 the spilled term is shifted out entirely.
    v |= (static_cast<uint64_t>(p[8]) << 1) << (63 - shift);
  }
  return v;
}

// OR the low `len` bits of v (already masked) into the stream at bit `pos`. Needs 9 bytes of
// zero-initialised slack after the last written bit.
IBP_HD void write_stream_bits(uint8_t* stream, uint64_t pos, uint64_t v, int len) {
  if (len == 0) return;
  uint8_t* p = stream + (pos >> 3);
  const int shift = static_cast<int>(pos & 7);
  uint64_t lo;
  memcpy(&lo, p, 8);
  lo |= v << shift;
  memcpy(p, &lo, 8);
  if (shift != 0 && len + shift > 64) p[8] |= static_cast<uint8_t>(v >> (64 - shift));
}

// Chunk j of a row as a little-endian W-bit integer, zero-padded past row_bytes.
template <int W>
IBP_HD uint64_t load_chunk(const uint8_t* row, int64_t row_bytes, int j) {
  constexpr int S = W / 8;
  const int64_t begin = static_cast<int64_t>(j) * S;
  uint64_t v = 0;
  if (begin + S <= row_bytes) {
    memcpy(&v, row + begin, S);
  } else {
    memcpy(&v, row + begin, static_cast<size_t>(row_bytes - begin));
  }
  return v;
}

template <int W>
IBP_HD void store_chunk(uint8_t* row, int64_t row_bytes, int j, uint64_t v) {
  constexpr int S = W / 8;
  const int64_t begin = static_cast<int64_t>(j) * S;
  if (begin + S <= row_bytes) {
    memcpy(row + begin, &v, S);
  } else {
    memcpy(row + begin, &v, static_cast<size_t>(row_bytes - begin));
  }
}

}  // namespace ibpembed
