# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the table tests: small tables and byte-level file surgery."""

from __future__ import annotations

import struct
from pathlib import Path

import torch
import xxhash

from ibpembed.tables import format as tf


def trained_like(rows: int, dim: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Small-valued rows (so IBP has invariant bits to find), a few zero rows, one outlier."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, dim, generator=gen) * 0.05
    values[torch.rand(rows, generator=gen) < 0.05] = 0.0
    values[rows // 2, 0] = 1e4
    return values.to(dtype).contiguous()


def with_a_raw_row(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Small fp32 rows but row 7, whose huge values no mask fits, so it is stored raw: a hot
    tier must hold raw rows as well as compressed ones."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, dim, generator=gen) * 0.05
    values[7] = torch.randn(dim, generator=gen) * 1e30
    return values


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), shapes and dtypes too."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def section_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """[begin, end) byte range of the header, the section table and each section."""
    loaded = tf.read_table(path)
    table_end = tf.HEADER.size + tf.SECTION.size * len(loaded.sections)
    ranges = {"header": (0, tf.HEADER.size), "section table": (tf.HEADER.size, table_end)}
    ranges.update({s.kind.label: (s.offset, s.offset + s.length) for s in loaded.sections})
    return ranges


def mapped_from(address: int) -> str | None:
    """The file whose mapping holds ``address`` in this process (Linux /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        begin, end = (int(x, 16) for x in fields[0].split("-"))
        if begin <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def reseal_section(path: Path, kind: tf.SectionKind, data: bytes) -> None:
    """Replace one section's bytes (same length) and rewrite every checksum over them: a file
    that lies about its table while every hash holds."""
    blob = bytearray(path.read_bytes())
    header = list(tf.HEADER.unpack_from(blob, 0))
    count = len(tf.read_table(path).sections)
    entries = [
        list(tf.SECTION.unpack_from(blob, tf.HEADER.size + i * tf.SECTION.size))
        for i in range(count)
    ]
    # SectionEntry: kind, reserved, offset, length, xxh3 (table_file.h).
    entry = next(e for e in entries if e[0] == kind)
    assert len(data) == entry[3]
    blob[entry[2] : entry[2] + entry[3]] = data
    entry[4] = xxhash.xxh3_64_intdigest(data)
    table = b"".join(tf.SECTION.pack(*e) for e in entries)
    blob[tf.HEADER.size : tf.HEADER.size + len(table)] = table
    header[-4] = xxhash.xxh3_64_intdigest(table)  # FileHeader.sections_xxh3
    hashed = tf.HEADER.pack(*header)[: tf.HEADER.size - 8]
    blob[: tf.HEADER.size] = hashed + struct.pack("<Q", xxhash.xxh3_64_intdigest(hashed))
    path.write_bytes(bytes(blob))
