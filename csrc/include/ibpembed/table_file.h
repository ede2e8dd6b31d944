// SPDX-License-Identifier: Apache-2.0
//
// The .ibpt table file (file version 2): one compressed table on disk, laid out so that a reader
// can mmap it and point the codec straight at its sections. Torch-free; docs/format.md is the
// prose version and service/ibpembed/tables/format.py the Python reader/writer, which packs these
// very structs with the struct module (tests compile this header and compare the offsets).
//
//   [0, 128)        FileHeader
//   [128, ...)      SectionEntry[section_count], one per SectionKind, in kind order
//   then sections, each at a multiple of kSectionAlign (the payload at a multiple of
//   kPayloadAlign), in the order mask, bitval, block_base, row_units, bitmask, payload, meta;
//   the gaps are zero bytes.
//
// All integers are little-endian. Checksums are XXH3-64 (seed 0) from the xxHash library. Every
// section carries its own checksum, the section table is covered by FileHeader::sections_xxh3 and
// the header by FileHeader::header_xxh3, so a reader can trust the index after hashing only the
// small sections and hash the (large) payload on demand.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed {

inline constexpr char kTableFileMagic[8] = {'I', 'B', 'P', 'T', 'A', 'B', 'L', 'E'};
inline constexpr uint32_t kTableFileVersion = 2;
inline constexpr uint64_t kSectionAlign = 64;    // cache line: every section starts aligned
inline constexpr uint64_t kPayloadAlign = 4096;  // page: the payload can be pinned/advised alone

// What a section holds. The element type and count of each follow from the header (V chunks per
// row, B = ceil(N / 32) blocks) and match the tensors of format.h exactly:
enum class SectionKind : uint32_t {
  kMask = 1,       // int64 [V]          per-position masks (uint64 bit patterns)
  kBitval = 2,     // int64 [V * K]      per-position codebooks (K = 2^C - 1, format.h)
  kBlockBase = 3,  // int64 [B + 1]      payload offset of each 32-row block, then the payload end
  kRowUnits = 4,   // uint8 [B * 32]     slot size of each row in units of unit_bytes
  kBitmask = 5,    // int32 [ceil(N/32)] bit set = row stored compressed
  kPayload = 6,    // uint8 [end + kPayloadPad] the slots back to back, then zero pad
  kMeta = 7,       // UTF-8 JSON object: name, source hash, fit parameters, features, pooling
};
inline constexpr uint32_t kSectionCount = 7;

// The first 128 bytes of every .ibpt file.
struct FileHeader {
  // kTableFileMagic; anything else is not an ibpembed table file.
  char magic[8];
  // kTableFileVersion. Readers reject versions they do not know rather than guess.
  uint32_t version;
  // sizeof(FileHeader): lets a later version grow the header while staying detectable.
  uint32_t header_bytes;
  // Number of SectionEntry records right after the header (kSectionCount in version 1).
  uint32_t section_count;
  // sizeof(SectionEntry).
  uint32_t section_entry_bytes;
  // Size of the whole file in bytes: a shorter file is truncated, a longer one has trailing junk.
  uint64_t file_bytes;
  // Table shape: N rows of dim elements, row_bytes = dim * element size.
  int64_t num_rows;
  int64_t dim;
  int64_t row_bytes;
  // Slot unit U of format.h (a power of two, raw slot <= kMaxUnitsPerRow units).
  int64_t unit_bytes;
  // ibpembed::DType of the stored elements (kInt8Rowwise for fbgemm row-wise int8 rows).
  int32_t dtype;
  // Chunk width W in bits: 16, 32 or 64.
  int32_t chunk_bits;
  // V = chunks_per_row(row_bytes, chunk_bits): entries in the mask section.
  uint32_t num_chunks;
  // kFormatVersion of format.h: the compact layout the sections are in.
  uint32_t layout_version;
  // XXH3-64 of the section_count * section_entry_bytes bytes of the section table.
  uint64_t sections_xxh3;
  // Code width C of format.h (1..4; the bitval section holds V * (2^C - 1) entries). Version 2;
  // in version 1 these bytes were reserved (zero) and C is 1.
  uint32_t code_bits;
  // Zero; readers reject non-zero bytes so that later use stays detectable.
  uint8_t reserved[28];
  // XXH3-64 of bytes [0, 120) of this header.
  uint64_t header_xxh3;
};

// One section: where it is and what its bytes hash to.
struct SectionEntry {
  uint32_t kind;    // SectionKind
  uint32_t flags;   // zero in version 1
  uint64_t offset;  // from the start of the file; a multiple of kSectionAlign
  uint64_t length;  // bytes
  uint64_t xxh3;    // XXH3-64 of the section's bytes
};

static_assert(sizeof(FileHeader) == 128, "FileHeader is part of the on-disk format");
static_assert(offsetof(FileHeader, version) == 8);
static_assert(offsetof(FileHeader, file_bytes) == 24);
static_assert(offsetof(FileHeader, num_rows) == 32);
static_assert(offsetof(FileHeader, unit_bytes) == 56);
static_assert(offsetof(FileHeader, dtype) == 64);
static_assert(offsetof(FileHeader, layout_version) == 76);
static_assert(offsetof(FileHeader, sections_xxh3) == 80);
static_assert(offsetof(FileHeader, code_bits) == 88);
static_assert(offsetof(FileHeader, reserved) == 92);
static_assert(offsetof(FileHeader, header_xxh3) == 120);
static_assert(sizeof(SectionEntry) == 32, "SectionEntry is part of the on-disk format");
static_assert(offsetof(SectionEntry, offset) == 8);
static_assert(offsetof(SectionEntry, xxh3) == 24);
static_assert(kPayloadAlign % kSectionAlign == 0);

}  // namespace ibpembed
