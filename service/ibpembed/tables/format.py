# SPDX-License-Identifier: Apache-2.0
"""The ``.ibpt`` table file: its layout (csrc/include/ibpembed/table_file.h, docs/format.md), and
reading and verifying it.

>>> loaded = read_table("user.ibpt")                        # mmap, header + index verified
>>> loaded.table.gather(torch.tensor([7, 3]))               # zero-copy CompressedTable
>>> verify_file("user.ibpt")                                # every checksum + full decode

Readers map the file copy-on-write (private): tensors are zero-copy views of the mapping and a
stray write can never reach the file. Writing is :mod:`ibpembed.tables.writer`.
"""

from __future__ import annotations

import contextlib
import enum
import json
import mmap
import os
import re
import struct
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ibpembed import _C, codec, layout
from ibpembed.codec import CompressedTable
from ibpembed.layout import DTYPE_CODES, INT8_ROWWISE_CODE, codebook_entries
from ibpembed.tables import _layout, mapping_guard

MAGIC = b"IBPTABLE"
VERSION = 2
# Version 1 files (layout 2, no code width field) read as code_bits = 1.
READABLE_VERSIONS = (1, 2)
# kFormatVersion of format.h as built into _C: a file in another compact layout is refused,
# never decoded with the wrong rules. Layout 2 is layout 3 with one-pattern codebooks (C = 1).
LAYOUT_VERSION = int(_C.FORMAT_VERSION)
READABLE_LAYOUTS = (2, LAYOUT_VERSION)
SECTION_ALIGN = 64
PAYLOAD_ALIGN = 4096
SUFFIX = ".ibpt"

# Must match FileHeader / SectionEntry in table_file.h (a test compiles the header to check).
HEADER = struct.Struct("<8sIIIIQqqqqiiIIQI28sQ")
SECTION = struct.Struct("<IIQQQ")
HEADER_HASHED = HEADER.size - 8  # the header checksum covers everything before itself

# Bytes of rows decoded per step by verify.
VERIFY_STEP_BYTES = 64 << 20


class SectionKind(enum.IntEnum):
    """Section kinds, in file order (SectionKind in table_file.h)."""

    MASK = 1
    BITVAL = 2
    BLOCK_BASE = 3
    ROW_UNITS = 4
    BITMASK = 5
    PAYLOAD = 6
    META = 7

    @property
    def label(self) -> str:
        return self.name.lower()


# The small sections: always hashed at load, because the decoder trusts them for addressing.
_INDEX_KINDS = tuple(k for k in SectionKind if k is not SectionKind.PAYLOAD)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


class TableFileError(ValueError):
    """A table file that cannot be used: names the file and the section at fault."""

    def __init__(self, path: str | os.PathLike[str], section: str, problem: str) -> None:
        self.path = str(path)
        self.section = section
        self.problem = problem
        super().__init__(f"{self.path}: section '{section}': {problem}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its three parts, so the error survives pickling (worker processes).
        return type(self), (self.path, self.section, self.problem)


@dataclass(frozen=True)
class FileHeader:
    """The decoded FileHeader of table_file.h (checksums as ints)."""

    version: int
    file_bytes: int
    num_rows: int
    dim: int
    row_bytes: int
    unit_bytes: int
    dtype_code: int
    chunk_bits: int
    num_chunks: int
    layout_version: int
    code_bits: int
    sections_xxh3: int
    header_xxh3: int

    @property
    def quant(self) -> str | None:
        return "int8_rowwise" if self.dtype_code == INT8_ROWWISE_CODE else None

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype as stored (uint8 for row-wise int8 rows)."""
        return torch.uint8 if self.quant else _DTYPES_BY_CODE[self.dtype_code]


@dataclass(frozen=True)
class Section:
    kind: SectionKind
    offset: int
    length: int
    xxh3: int


@dataclass(frozen=True)
class FileLayout:
    """A table file's header, sections and metadata: what is read of it without decoding."""

    path: Path
    header: FileHeader
    sections: tuple[Section, ...]
    meta: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.meta["name"])


@dataclass(frozen=True, eq=False)
class TableFile(FileLayout):
    """A loaded table file: its layout and the zero-copy table."""

    table: CompressedTable


# -- small helpers ---------------------------------------------------------------------------


def align(offset: int, alignment: int) -> int:
    return layout.ceil_div(offset, alignment) * alignment


def hex64(value: int) -> str:
    return f"{value:016x}"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def dtype_code(dtype: torch.dtype, quant: str | None) -> int:
    return INT8_ROWWISE_CODE if quant == "int8_rowwise" else DTYPE_CODES[dtype]


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    # ndarray.data is the array's buffer: numpy types ndarray as a Buffer only on Python 3.12+.
    return flat.numpy().data.cast("B")


# File names hold at most 255 bytes (Linux file systems); a table's file adds 22 to its stem
# (".<16 hex>.ibpt"), and so does its temporary file (".<stem>.tmp-<pid>-<8 hex>").
MAX_FILE_STEM = 200


def file_stem(name: str) -> str:
    """A file-name-safe form of a table name (table names may hold dots, slashes, spaces), cut
    to ``MAX_FILE_STEM`` characters. Table files are content-named (``<stem>.<header
    checksum>.ibpt``, and the checksum covers the meta section, which holds the full name), so
    two long names with one stem still get two files."""
    return (re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "table")[:MAX_FILE_STEM]


def row_steps(num_rows: int, row_bytes: int, step_bytes: int) -> Iterator[tuple[int, int]]:
    """[begin, end) row ranges of about step_bytes, each starting on a 32-row block."""
    step = max(layout.ROWS_PER_BLOCK, step_bytes // max(row_bytes, 1))
    step -= step % layout.ROWS_PER_BLOCK
    for begin in range(0, num_rows, step):
        yield begin, min(begin + step, num_rows)


def decoded_xxh3(table: CompressedTable, step_bytes: int = VERIFY_STEP_BYTES) -> int:
    """XXH3-64 of the decoded table bytes, decoding a bounded number of rows at a time."""
    digest = xxhash.xxh3_64()
    for begin, end in row_steps(table.num_rows, table.row_bytes, step_bytes):
        digest.update(as_bytes(table.gather(torch.arange(begin, end))))
    return digest.intdigest()


class SectionPlan:
    """File offsets of the sections; all but the meta section are known from the shape alone."""

    def __init__(self, num_rows: int, num_chunks: int, code_bits: int) -> None:
        blocks = layout.num_blocks(num_rows)
        self.lengths: dict[SectionKind, int] = {
            SectionKind.MASK: 8 * num_chunks,
            SectionKind.BITVAL: 8 * codebook_entries(num_chunks, code_bits),
            SectionKind.BLOCK_BASE: 8 * (blocks + 1),
            SectionKind.ROW_UNITS: blocks * layout.ROWS_PER_BLOCK,
            SectionKind.BITMASK: 4 * layout.bitmask_words(num_rows),
        }
        self.offsets: dict[SectionKind, int] = {}
        cursor = HEADER.size + SECTION.size * len(SectionKind)
        for kind, length in self.lengths.items():
            cursor = align(cursor, SECTION_ALIGN)
            self.offsets[kind] = cursor
            cursor += length
        self.offsets[SectionKind.PAYLOAD] = align(cursor, PAYLOAD_ALIGN)

    def place_tail(self, payload_bytes: int, meta_bytes: int) -> int:
        """Place payload and meta; returns the file size."""
        self.lengths[SectionKind.PAYLOAD] = payload_bytes
        meta_offset = align(self.offsets[SectionKind.PAYLOAD] + payload_bytes, SECTION_ALIGN)
        self.offsets[SectionKind.META] = meta_offset
        self.lengths[SectionKind.META] = meta_bytes
        return meta_offset + meta_bytes


# -- reading ---------------------------------------------------------------------------------


def read_header(
    path: str | os.PathLike[str], data: memoryview | bytes, size: int, *, any_layout: bool = False
) -> FileHeader:
    """Decode and check the header: magic, version, checksum, layout, shape, size.

    ``any_layout`` accepts rows in a compact layout this build cannot decode (for ``inspect``).
    """
    if size < len(MAGIC) or bytes(data[: len(MAGIC)]) != MAGIC:
        raise TableFileError(path, "header", "not an ibpembed table file (bad magic)")
    if size < HEADER.size:
        raise TableFileError(
            path, "header", f"truncated: file has {size} bytes, the header alone is {HEADER.size}"
        )
    fields = HEADER.unpack(bytes(data[: HEADER.size]))
    (
        _,
        version,
        header_bytes,
        section_count,
        entry_bytes,
        file_bytes,
        num_rows,
        dim,
        row_bytes,
        unit_bytes,
        code,
        chunk_bits,
        num_chunks,
        layout_version,
        sections_xxh3,
        code_bits,
        reserved,
        header_xxh3,
    ) = fields
    if version not in READABLE_VERSIONS:
        raise TableFileError(
            path,
            "header",
            f"unknown file version {version} (this reader "
            f"knows versions {READABLE_VERSIONS}); repack with this ibpembed",
        )
    computed = xxhash.xxh3_64_intdigest(bytes(data[:HEADER_HASHED]))
    if computed != header_xxh3:
        raise TableFileError(
            path,
            "header",
            f"checksum mismatch (stored {hex64(header_xxh3)}, computed {hex64(computed)})",
        )
    if (header_bytes, section_count, entry_bytes) != (HEADER.size, len(SectionKind), SECTION.size):
        raise TableFileError(path, "header", "unexpected header/section table sizes")
    if layout_version not in READABLE_LAYOUTS and not any_layout:
        raise TableFileError(
            path,
            "header",
            f"rows are in compact layout version {layout_version}, this build decodes versions "
            f"{READABLE_LAYOUTS}; repack the table",
        )
    if any(reserved):
        raise TableFileError(path, "header", "reserved header bytes are set")
    if version == 1:
        if code_bits != 0:  # still reserved in version 1
            raise TableFileError(path, "header", "reserved header bytes are set")
        code_bits = 1
    if code_bits not in codec.CODE_BITS_CHOICES or (layout_version < 3 and code_bits != 1):
        raise TableFileError(
            path, "header", f"code width {code_bits} is invalid for layout {layout_version}"
        )
    if code not in (*_DTYPES_BY_CODE, INT8_ROWWISE_CODE):
        raise TableFileError(path, "header", f"unknown dtype code {code}")
    if num_rows <= 0 or dim <= 0 or chunk_bits not in codec.CHUNK_BITS_CHOICES:
        raise TableFileError(
            path, "header", f"invalid shape [{num_rows}, {dim}] or chunk width {chunk_bits}"
        )
    dtype = torch.uint8 if code == INT8_ROWWISE_CODE else _DTYPES_BY_CODE[code]
    if (
        row_bytes != dim * dtype.itemsize
        or unit_bytes != codec.slot_unit_bytes(row_bytes, unit_bytes)
        or num_chunks != layout.num_chunks(row_bytes, chunk_bits)
    ):
        raise TableFileError(path, "header", "row width, slot unit and chunk count disagree")
    if size < file_bytes:
        raise TableFileError(
            path, "header", f"truncated: header says {file_bytes} bytes, file has {size}"
        )
    if size > file_bytes:
        raise TableFileError(
            path, "header", f"{size - file_bytes} unexpected bytes after the end of the table"
        )
    return FileHeader(
        version=version,
        file_bytes=file_bytes,
        num_rows=num_rows,
        dim=dim,
        row_bytes=row_bytes,
        unit_bytes=unit_bytes,
        dtype_code=code,
        chunk_bits=chunk_bits,
        num_chunks=num_chunks,
        layout_version=layout_version,
        code_bits=code_bits,
        sections_xxh3=sections_xxh3,
        header_xxh3=header_xxh3,
    )


def read_sections(
    path: str | os.PathLike[str], data: memoryview | bytes, header: FileHeader
) -> tuple[Section, ...]:
    """Decode and check the section table: checksum, kinds, bounds, expected lengths."""
    begin = HEADER.size
    raw = bytes(data[begin : begin + SECTION.size * len(SectionKind)])
    computed = xxhash.xxh3_64_intdigest(raw)
    if computed != header.sections_xxh3:
        raise TableFileError(
            path,
            "section table",
            f"checksum mismatch (stored {hex64(header.sections_xxh3)}, computed {hex64(computed)})",
        )
    plan = SectionPlan(header.num_rows, header.num_chunks, header.code_bits)
    sections = []
    previous_end = begin + len(raw)
    for i, kind in enumerate(SectionKind):
        code, flags, offset, length, digest = SECTION.unpack_from(raw, i * SECTION.size)
        if code != kind or flags != 0:
            raise TableFileError(
                path,
                "section table",
                f"entry {i} has kind {code}, expected {int(kind)} ({kind.label})",
            )
        expected = plan.lengths.get(kind)
        if (expected is not None and length != expected) or (
            kind is SectionKind.PAYLOAD and length < layout.PAYLOAD_PAD
        ):
            raise TableFileError(path, kind.label, f"length {length}, expected {expected}")
        if offset % SECTION_ALIGN or offset < previous_end or offset + length > header.file_bytes:
            raise TableFileError(
                path,
                kind.label,
                f"bad placement [{offset}, {offset + length}) in a {header.file_bytes}-byte file",
            )
        previous_end = offset + length
        sections.append(Section(kind, offset, length, digest))
    return tuple(sections)


def _check_section(path: Path, data: memoryview, section: Section) -> None:
    # Released before any error: a slice left in the traceback's frame would keep the mapping.
    with data[section.offset : section.offset + section.length] as blob:
        computed = xxhash.xxh3_64_intdigest(blob)
    if computed != section.xxh3:
        raise TableFileError(
            path,
            section.kind.label,
            f"checksum mismatch (stored {hex64(section.xxh3)}, computed {hex64(computed)})",
        )


def _check_gaps(path: Path, data: memoryview, sections: tuple[Section, ...]) -> None:
    """The alignment gaps must be zero: with them every byte of the file is checked, so no
    flipped byte anywhere goes unnoticed."""
    cursor = HEADER.size + SECTION.size * len(sections)
    for section in sections:
        if any(data[cursor : section.offset]):
            raise TableFileError(path, section.kind.label, "non-zero bytes in the gap before it")
        cursor = section.offset + section.length


def check_sections(
    path: Path, data: memoryview, sections: tuple[Section, ...], *, payload: bool
) -> None:
    """The zero gaps and the checksums of every section but the payload, and the payload's too
    with ``payload`` (the one large section: hashing it reads every byte)."""
    by_kind = {s.kind: s for s in sections}
    _check_gaps(path, data, sections)
    for kind in _INDEX_KINDS:
        _check_section(path, data, by_kind[kind])
    if payload:
        _check_section(path, data, by_kind[SectionKind.PAYLOAD])


def parse_meta(path: Path, data: memoryview, sections: tuple[Section, ...]) -> dict[str, Any]:
    """The meta section: a JSON object with a string ``name``."""
    meta_section = next(s for s in sections if s.kind is SectionKind.META)
    try:
        meta = json.loads(
            bytes(data[meta_section.offset : meta_section.offset + meta_section.length])
        )
    except ValueError as exc:
        raise TableFileError(path, "meta", f"not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise TableFileError(path, "meta", "expected a JSON object with a 'name'")
    return meta


def read_layout(path: str | os.PathLike[str]) -> FileLayout:
    """A table file's header, sections and metadata (for ``ibpembed inspect``): the checks
    :func:`read_table` makes before it builds the table, but the payload's checksum, and in any
    compact layout (nothing is decoded). Of the payload, no byte is read.

    Raises
    ------
    TableFileError
        naming the file and the section, for a foreign, truncated or corrupt file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size:
            read_header(path, f.read(), size, any_layout=True)  # raises the precise error
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(data)
    try:
        header = read_header(path, view, size, any_layout=True)
        sections = read_sections(path, view, header)
        check_sections(path, view, sections, payload=False)
        meta = parse_meta(path, view, sections)
    finally:
        # Unmapped now rather than when an error's traceback is freed (the checks have let go
        # of every slice they took).
        view.release()
        with contextlib.suppress(BufferError):
            data.close()
    return FileLayout(path=path, header=header, sections=sections, meta=meta)


def check_index(path: Path, table: CompressedTable) -> None:
    """Structural checks the decoder relies on, beyond the checksums: a valid, compact layout
    whose every slot lies inside the payload."""
    lengths = _layout.block_bytes(table.row_units, table.unit_bytes)
    starts = torch.cumsum(lengths, 0) - lengths
    if not torch.equal(table.block_base[:-1], starts) or int(table.block_base[-1]) != int(
        lengths.sum()
    ):
        raise TableFileError(path, "block_base", "block offsets disagree with the row sizes")
    if int(table.block_base[-1]) + layout.PAYLOAD_PAD != table.payload.numel():
        raise TableFileError(
            path,
            "payload",
            f"holds {table.payload.numel()} bytes, the index "
            f"addresses {int(table.block_base[-1])} + pad",
        )
    max_units = -(-table.row_bytes // table.unit_bytes)
    real = table.row_units[: table.num_rows]
    if (
        int(real.min()) == 0
        or int(real.max()) > max_units
        or bool(table.row_units[table.num_rows :].any())
    ):
        raise TableFileError(path, "row_units", "row slot sizes out of range")
    # format.h: a row is stored compressed iff its slot is smaller than a raw one. Decoders rely
    # on it to bound what they read (a "raw" row with a short slot would be copied past it).
    # One bit per row, little-endian within the int32 words: unpacked in C, ~1 ms per 1M rows.
    compressed = np.unpackbits(table.bitmask.numpy().view(np.uint8), bitorder="little")
    if bool((compressed[: table.num_rows] != (real.numpy() < max_units)).any()):
        raise TableFileError(
            path, "row_units", "a row's slot size disagrees with its compressed bit"
        )
    if table.chunk_bits < 64 and bool((table.mask >> table.chunk_bits).any()):
        raise TableFileError(path, "mask", "mask bits above the chunk width")
    codebooks = table.bitval.view(table.mask.numel(), -1)  # [V, K], sized by the header's C
    if bool((codebooks & ~table.mask[:, None]).any()):
        raise TableFileError(path, "bitval", "codebook bits outside the mask")


def _tensor(data: mmap.mmap, section: Section, dtype: torch.dtype) -> torch.Tensor:
    # torch.frombuffer holds a reference to the mmap, so the mapping lives as long as any tensor.
    with warnings.catch_warnings():
        # A shared mapping is read-only, which torch warns about: nothing writes a table's
        # tensors (row updates go to spill buffers), so the warning says nothing here.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(
            data, dtype=dtype, count=section.length // dtype.itemsize, offset=section.offset
        )


# NOTE(tables): Linux caps one MADV_WILLNEED at the device's readahead window (read_ahead_kb,
# 8 MiB on the development VM: one call over a 57 MiB payload read 15 % of it), so the payload
# is advised in steps of this size.
_PREFETCH_STEP = 4 << 20


def _prefetch(data: mmap.mmap, section: Section) -> None:
    """Start reading a section's pages from storage (madvise wants page-aligned starts)."""
    start = section.offset - section.offset % mmap.PAGESIZE
    end = section.offset + section.length
    for step in range(start, end, _PREFETCH_STEP):
        data.madvise(mmap.MADV_WILLNEED, step, min(_PREFETCH_STEP, end - step))


def read_table(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    prefetch: bool = False,
    shared: bool = False,
) -> TableFile:
    """Map a table file and return its zero-copy table.

    The file is mapped copy-on-write (``MAP_PRIVATE``), or with ``shared=True`` read-only and
    shared (``MAP_SHARED``, ``PROT_READ``): what a GPU's long-term pin of the payload
    (``cudaHostRegister``) needs to pin the page-cache pages themselves, since Linux >= 6.2
    breaks copy-on-write for such pins of a private file mapping, copying every payload page
    into anonymous memory. A shared mapping's tensors must never be written (a write faults).

    The header, section table, metadata, masks and index are always checked (checksums and
    structure); the payload checksum only with ``verify=True`` (it reads every byte).
    ``prefetch=True`` has the kernel read the payload into the page cache
    (``madvise(MADV_WILLNEED)``): lookups then find the rows in memory instead of each waiting on
    its own read from storage. The reads are queued, not waited for, but queueing blocks while
    the device's queue is full: from a cold cache the call then takes about as long as reading
    the payload (0.36 s/GiB on the development VM against 0.03 s/GiB without; BENCHMARKS.md).

    Raises
    ------
    TableFileError
        naming the file and the section, for a foreign, truncated, corrupt or unknown-version
        file. Nothing stays mapped after an error.
    """
    if sys.byteorder != "little":  # the file and every tensor in it are little-endian
        raise TableFileError(path, "header", "big-endian hosts are not supported")
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size:
            read_header(path, f.read(), size)  # raises with the most precise message
        access = mmap.ACCESS_READ if shared else mmap.ACCESS_COPY
        data = mmap.mmap(f.fileno(), 0, access=access)
    mapping_guard.guard(data)
    view = memoryview(data)
    try:
        header = read_header(path, view, size)
        sections = read_sections(path, view, header)
        by_kind = {s.kind: s for s in sections}
        check_sections(path, view, sections, payload=verify)
        if prefetch and not verify:
            _prefetch(data, by_kind[SectionKind.PAYLOAD])
        meta = parse_meta(path, view, sections)
        table = CompressedTable(
            payload=_tensor(data, by_kind[SectionKind.PAYLOAD], torch.uint8),
            block_base=_tensor(data, by_kind[SectionKind.BLOCK_BASE], torch.int64),
            row_units=_tensor(data, by_kind[SectionKind.ROW_UNITS], torch.uint8),
            bitmask=_tensor(data, by_kind[SectionKind.BITMASK], torch.int32),
            mask=_tensor(data, by_kind[SectionKind.MASK], torch.int64),
            bitval=_tensor(data, by_kind[SectionKind.BITVAL], torch.int64),
            chunk_bits=header.chunk_bits,
            num_rows=header.num_rows,
            dim=header.dim,
            dtype=header.dtype,
            unit_bytes=header.unit_bytes,
            quant=header.quant,
        )
        check_index(path, table)
        return TableFile(path=path, header=header, sections=sections, meta=meta, table=table)
    except BaseException:
        # Unmapped now, not when the traceback (whose frame holds the mapping) is freed: a
        # reload's outcome may keep its error. The tensors made so far export the mapping.
        table = None
        view.release()
        with contextlib.suppress(BufferError):
            data.close()
        raise
    finally:
        view.release()  # the tensors hold their own references to the mapping


def verify_file(path: str | os.PathLike[str]) -> TableFile:
    """Check every checksum, decode every row and compare with the source hash.

    Raises
    ------
    TableFileError
        on the first fault, naming the file and the section.
    """
    loaded = read_table(path, verify=True)
    expected = loaded.meta.get("source_xxh3")
    try:
        computed = hex64(decoded_xxh3(loaded.table))
    except (RuntimeError, ValueError) as exc:  # the codec rejects what it cannot decode
        raise TableFileError(path, "payload", f"decode failed: {exc}") from None
    if computed != expected:
        raise TableFileError(
            path, "payload", f"decoded rows hash to {computed}, the source hashed to {expected}"
        )
    return loaded
