# SPDX-License-Identifier: Apache-2.0
"""Read and write ``.ibpt`` table files (csrc/include/ibpembed/table_file.h, docs/format.md).

>>> info = pack_table("user.ibpt", weight, name="user")    # compress + write, streaming
>>> loaded = read_table("user.ibpt")                        # mmap, header + index verified
>>> loaded.table.gather(torch.tensor([7, 3]))               # zero-copy CompressedTable
>>> verify_file("user.ibpt")                                # every checksum + full decode

Writers are atomic: they write a temporary file next to the target, fsync it, rename it over the
target and fsync the directory, so a crash at any moment leaves either the old file or the new
one under the final name, never a mix. Readers map the file copy-on-write (private): tensors are
zero-copy views of the mapping and a stray write can never reach the file.
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import re
import secrets
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from ibpembed import _C, codec
from ibpembed._ops import DTYPE_CODES, INT8_ROWWISE_CODE, codebook_entries, ops
from ibpembed.codec import CompressedTable
from ibpembed.tables import _layout

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
TEMP_MARKER = ".tmp-"  # temporary files are ".<table stem>.tmp-<pid>-<random>"

# Must match FileHeader / SectionEntry in table_file.h (a test compiles the header to check).
HEADER = struct.Struct("<8sIIIIQqqqqiiIIQI28sQ")
SECTION = struct.Struct("<IIQQQ")
_HEADER_HASHED = HEADER.size - 8  # the header checksum covers everything before itself

# Bytes of source rows compressed per step while packing: bounds pack memory to the source
# plus about this much, whatever the table size.
PACK_STEP_BYTES = 64 << 20
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


@dataclass(frozen=True)
class Section:
    kind: SectionKind
    offset: int
    length: int
    xxh3: int


@dataclass(frozen=True, eq=False)
class TableFile:
    """A loaded table file: its header, sections, metadata and the zero-copy table."""

    path: Path
    header: FileHeader
    sections: tuple[Section, ...]
    meta: Mapping[str, Any]
    table: CompressedTable

    @property
    def name(self) -> str:
        return str(self.meta["name"])


@dataclass(frozen=True)
class PackedTable:
    """What a writer produced: one row of the ``ibpembed pack`` report."""

    name: str
    path: Path
    num_rows: int
    dim: int
    dtype: str
    quant: str | None
    chunk_bits: int
    code_bits: int
    unit_bytes: int
    raw_bytes: int
    payload_bytes: int
    index_bytes: int
    metadata_bytes: int
    file_bytes: int
    header_xxh3: int
    seconds: float

    @property
    def stored_bytes(self) -> int:
        return self.payload_bytes + self.index_bytes + self.metadata_bytes

    @property
    def savings(self) -> float:
        return 1.0 - self.stored_bytes / self.raw_bytes


# -- small helpers ---------------------------------------------------------------------------


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _hex(value: int) -> str:
    return f"{value:016x}"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def dtype_code(dtype: torch.dtype, quant: str | None) -> int:
    return INT8_ROWWISE_CODE if quant == "int8_rowwise" else DTYPE_CODES[dtype]


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def file_stem(name: str) -> str:
    """A file-name-safe form of a table name (table names may hold dots, slashes, spaces)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "table"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicWriter:
    """A temporary file in the target's directory that becomes the target only on ``commit``.

    Used as a context manager: leaving the block without ``commit`` (an exception) removes the
    temporary file. ``commit`` fsyncs the data, renames it into place and fsyncs the directory, so
    the rename itself survives a power cut.
    """

    def __init__(self, directory: str | os.PathLike[str], stem: str) -> None:
        self.directory = Path(directory)
        nonce = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.temp_path = self.directory / f".{stem}{TEMP_MARKER}{nonce}"
        self.file: BinaryIO = open(self.temp_path, "xb")  # noqa: SIM115  (closed in commit/exit)
        self._committed = False

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self.file.close()
            self.temp_path.unlink(missing_ok=True)

    def commit(self, final_path: str | os.PathLike[str]) -> Path:
        final_path = Path(final_path)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.temp_path, final_path)
        self._committed = True
        _fsync_dir(final_path.parent)
        return final_path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write a small file (a manifest) atomically."""
    path = Path(path)
    with AtomicWriter(path.parent, path.name) as writer:
        writer.file.write(data)
        return writer.commit(path)


# -- writing ---------------------------------------------------------------------------------


class _SectionPlan:
    """File offsets of the sections; all but the meta section are known from the shape alone."""

    def __init__(self, num_rows: int, num_chunks: int, code_bits: int) -> None:
        blocks = _layout.num_blocks(num_rows)
        self.lengths: dict[SectionKind, int] = {
            SectionKind.MASK: 8 * num_chunks,
            SectionKind.BITVAL: 8 * codebook_entries(num_chunks, code_bits),
            SectionKind.BLOCK_BASE: 8 * (blocks + 1),
            SectionKind.ROW_UNITS: blocks * _layout.ROWS_PER_BLOCK,
            SectionKind.BITMASK: 4 * (-(-num_rows // 32)),
        }
        self.offsets: dict[SectionKind, int] = {}
        cursor = HEADER.size + SECTION.size * len(SectionKind)
        for kind, length in self.lengths.items():
            cursor = _align(cursor, SECTION_ALIGN)
            self.offsets[kind] = cursor
            cursor += length
        self.offsets[SectionKind.PAYLOAD] = _align(cursor, PAYLOAD_ALIGN)

    def place_tail(self, payload_bytes: int, meta_bytes: int) -> int:
        """Place payload and meta; returns the file size."""
        self.lengths[SectionKind.PAYLOAD] = payload_bytes
        meta_offset = _align(self.offsets[SectionKind.PAYLOAD] + payload_bytes, SECTION_ALIGN)
        self.offsets[SectionKind.META] = meta_offset
        self.lengths[SectionKind.META] = meta_bytes
        return meta_offset + meta_bytes


class _TableFileWriter:
    """Writes one table file into an open binary file: payload streamed first, index last."""

    def __init__(self, file: BinaryIO, num_rows: int, num_chunks: int, code_bits: int) -> None:
        self.file = file
        self.code_bits = code_bits
        self.plan = _SectionPlan(num_rows, num_chunks, code_bits)
        self.payload_hash = xxhash.xxh3_64()
        self.payload_bytes = 0
        file.seek(self.plan.offsets[SectionKind.PAYLOAD])

    def write_payload(self, data: memoryview) -> None:
        self.payload_hash.update(data)
        self.file.write(data)
        self.payload_bytes += len(data)

    def finish(
        self,
        table_shape: tuple[int, int, int, int, int, int],
        index: Mapping[SectionKind, torch.Tensor],
        meta: Mapping[str, Any],
    ) -> tuple[int, int]:
        """Write the small sections, the section table and the header; returns
        (header_xxh3, file_bytes). ``table_shape`` is (num_rows, dim, row_bytes, unit_bytes,
        dtype_code, chunk_bits)."""
        self.write_payload(memoryview(bytes(_layout.PAYLOAD_PAD)))
        meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        file_bytes = self.plan.place_tail(self.payload_bytes, len(meta_bytes))
        hashes = {SectionKind.PAYLOAD: self.payload_hash.intdigest()}
        blobs: dict[SectionKind, memoryview] = {k: _as_bytes(t) for k, t in index.items()}
        blobs[SectionKind.META] = memoryview(meta_bytes)
        for kind, blob in blobs.items():
            if len(blob) != self.plan.lengths[kind]:
                raise AssertionError(
                    f"section {kind.label}: {len(blob)} bytes, planned {self.plan.lengths[kind]}"
                )
            self.file.seek(self.plan.offsets[kind])
            self.file.write(blob)
            hashes[kind] = xxhash.xxh3_64_intdigest(blob)
        self.file.truncate(file_bytes)  # zero-fills up to the end; also drops any longer tail
        table = b"".join(
            SECTION.pack(kind, 0, self.plan.offsets[kind], self.plan.lengths[kind], hashes[kind])
            for kind in SectionKind
        )
        num_rows, dim, row_bytes, unit_bytes, code, chunk_bits = table_shape
        num_chunks = index[SectionKind.MASK].numel()
        head = HEADER.pack(
            MAGIC,
            VERSION,
            HEADER.size,
            len(SectionKind),
            SECTION.size,
            file_bytes,
            num_rows,
            dim,
            row_bytes,
            unit_bytes,
            code,
            chunk_bits,
            num_chunks,
            LAYOUT_VERSION,
            xxhash.xxh3_64_intdigest(table),
            self.code_bits,
            bytes(28),
            0,
        )
        header_xxh3 = xxhash.xxh3_64_intdigest(head[:_HEADER_HASHED])
        self.file.seek(0)
        self.file.write(head[:_HEADER_HASHED] + struct.pack("<Q", header_xxh3) + table)
        return header_xxh3, file_bytes


def _meta(name: str, quant: str | None, source_xxh3: int, extra: Mapping[str, Any] | None) -> dict:
    meta: dict[str, Any] = dict(extra or {})
    meta.update(name=name, quant=quant, source_xxh3=_hex(source_xxh3))
    return meta


def _row_steps(num_rows: int, row_bytes: int, step_bytes: int) -> Iterator[tuple[int, int]]:
    """[begin, end) row ranges of about step_bytes, each starting on a 32-row block."""
    step = max(_layout.ROWS_PER_BLOCK, step_bytes // max(row_bytes, 1))
    step -= step % _layout.ROWS_PER_BLOCK
    for begin in range(0, num_rows, step):
        yield begin, min(begin + step, num_rows)


def _pack_into(
    file: BinaryIO,
    weight: torch.Tensor,
    *,
    name: str,
    quant: str | None,
    method: codec.Method,
    sample_rows: int | None,
    seed: int,
    align: int | None,
    chunk_bits: int | None,
    code_bits: int | None,
    meta: Mapping[str, Any] | None,
    progress: Callable[[int], None] | None,
) -> _Written:
    """Fit on a sample, then compress and write step by step."""
    # The same sample and fit as codec.compress, so the file holds exactly its bytes.
    fitted = codec.fit_table(
        weight,
        method=method,
        sample_rows=sample_rows,
        seed=seed,
        align=align,
        chunk_bits=chunk_bits,
        code_bits=code_bits,
        quant=quant,
    )
    num_rows, dim = weight.shape
    rows = weight.view(torch.uint8).view(num_rows, -1)
    row_bytes = rows.shape[1]
    bits, mask, bitval, unit = fitted.chunk_bits, fitted.mask, fitted.bitval, fitted.unit_bytes
    blocks = _layout.num_blocks(num_rows)
    block_base = torch.empty(blocks + 1, dtype=torch.int64)
    row_units = torch.zeros(blocks * _layout.ROWS_PER_BLOCK, dtype=torch.uint8)
    bitmask = torch.zeros(-(-num_rows // 32), dtype=torch.int32)
    writer = _TableFileWriter(file, num_rows, mask.numel(), fitted.code_bits)
    source_hash = xxhash.xxh3_64()
    for begin, end in _row_steps(num_rows, row_bytes, PACK_STEP_BYTES):
        step = rows[begin:end]
        source_hash.update(_as_bytes(step))
        payload, base, units, compressed = ops.ibp_compress(step, bits, mask, bitval, unit)
        b0, nb = begin // _layout.ROWS_PER_BLOCK, base.numel() - 1
        block_base[b0 : b0 + nb] = base[:-1] + writer.payload_bytes
        row_units[begin : begin + units.numel()] = units
        bitmask[b0 : b0 + compressed.numel()] = compressed
        writer.write_payload(_as_bytes(payload[: int(base[-1])]))
        if progress is not None:
            progress(end - begin)
    block_base[-1] = writer.payload_bytes
    index = {
        SectionKind.MASK: mask,
        SectionKind.BITVAL: bitval,
        SectionKind.BLOCK_BASE: block_base,
        SectionKind.ROW_UNITS: row_units,
        SectionKind.BITMASK: bitmask,
    }
    fit_meta = {"method": method, "align": align, "sample_rows": sample_rows, "seed": seed}
    header_xxh3, file_bytes = writer.finish(
        (num_rows, dim, row_bytes, unit, dtype_code(weight.dtype, quant), bits),
        index,
        _meta(name, quant, source_hash.intdigest(), {**fit_meta, **(meta or {})}),
    )
    return _Written(
        num_rows,
        dim,
        weight.dtype,
        quant,
        bits,
        unit,
        mask.numel(),
        fitted.code_bits,
        writer.payload_bytes,
        header_xxh3,
        file_bytes,
    )


@dataclass(frozen=True)
class _Written:
    """What a writer put in a file, before it has a final name."""

    num_rows: int
    dim: int
    dtype: torch.dtype
    quant: str | None
    chunk_bits: int
    unit_bytes: int
    num_chunks: int
    code_bits: int
    payload_bytes: int  # pad included, like CompressedTable.payload_bytes
    header_xxh3: int
    file_bytes: int

    def summary(self, name: str, path: Path, seconds: float) -> PackedTable:
        blocks = _layout.num_blocks(self.num_rows)
        return PackedTable(
            name=name,
            path=path,
            num_rows=self.num_rows,
            dim=self.dim,
            dtype=dtype_name(self.dtype),
            quant=self.quant,
            chunk_bits=self.chunk_bits,
            code_bits=self.code_bits,
            unit_bytes=self.unit_bytes,
            raw_bytes=self.num_rows * self.dim * self.dtype.itemsize,
            payload_bytes=self.payload_bytes,
            index_bytes=8 * (blocks + 1) + blocks * _layout.ROWS_PER_BLOCK,
            metadata_bytes=4 * (-(-self.num_rows // 32))
            + 8 * (self.num_chunks + codebook_entries(self.num_chunks, self.code_bits)),
            file_bytes=self.file_bytes,
            header_xxh3=self.header_xxh3,
            seconds=seconds,
        )


def _destination(
    path: str | os.PathLike[str], name: str, content_named: bool
) -> tuple[Path, Callable[[int], Path]]:
    """(directory of the temporary file, final path as a function of the header checksum)."""
    path = Path(path)
    if content_named:
        return path, lambda digest: path / f"{file_stem(name)}.{digest:016x}{SUFFIX}"
    return path.parent, lambda _digest: path


def pack_table(
    path: str | os.PathLike[str],
    weight: torch.Tensor,
    *,
    name: str,
    content_named: bool = False,
    quant: str | None = None,
    method: codec.Method = "ibpembed",
    sample_rows: int | None = codec.DEFAULT_SAMPLE_ROWS,
    seed: int = 0,
    align: int | None = codec.DEFAULT_ALIGN,
    chunk_bits: int | None = None,
    code_bits: int | None = None,
    meta: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> PackedTable:
    """Compress ``weight`` and write it as one table file, atomically, in bounded memory.

    The fit sees a random row sample; rows are then compressed ``PACK_STEP_BYTES`` at a time and
    streamed to disk, so memory stays near the source size plus one step (the bytes equal those
    of ``codec.compress`` with the same arguments).

    Parameters
    ----------
    path : the target file; with ``content_named``, the directory to write
        ``<name>.<header checksum>.ibpt`` into (the files of a table set).
    weight : [N, D] contiguous CPU tensor (fp32/fp16/bf16/int8/uint8).
    name : table name recorded in the file.
    quant, method, sample_rows, seed, align, chunk_bits, code_bits : as for ``codec.compress``.
    meta : extra JSON-serialisable fields for the meta section (features, pooling, origin).
    progress : called with the number of rows done after each step.

    Returns
    -------
    PackedTable: sizes, checksum and wall time.
    """
    start = time.perf_counter()
    directory, final_path = _destination(path, name, content_named)
    with AtomicWriter(directory, file_stem(name)) as writer:
        written = _pack_into(
            writer.file,
            weight,
            name=name,
            quant=quant,
            method=method,
            sample_rows=sample_rows,
            seed=seed,
            align=align,
            chunk_bits=chunk_bits,
            code_bits=code_bits,
            meta=meta,
            progress=progress,
        )
        final = writer.commit(final_path(written.header_xxh3))
    return written.summary(name, final, time.perf_counter() - start)


def decoded_xxh3(table: CompressedTable, step_bytes: int = VERIFY_STEP_BYTES) -> int:
    """XXH3-64 of the decoded table bytes, decoding a bounded number of rows at a time."""
    digest = xxhash.xxh3_64()
    for begin, end in _row_steps(table.num_rows, table.row_bytes, step_bytes):
        digest.update(_as_bytes(table.gather(torch.arange(begin, end))))
    return digest.intdigest()


def write_table(
    path: str | os.PathLike[str],
    table: CompressedTable,
    *,
    name: str,
    content_named: bool = False,
    meta: Mapping[str, Any] | None = None,
) -> PackedTable:
    """Write an already compressed table (e.g. one with row updates) as a file, atomically.

    The source hash is recomputed by decoding the table step by step, so the file verifies
    exactly like a packed one. A table whose payload has spilled blocks is compacted first.
    ``path`` and ``content_named`` are as for ``pack_table``.
    """
    start = time.perf_counter()
    if not _layout.is_compact(table):
        table, _ = _layout.compact(table)
    source = decoded_xxh3(table)
    directory, final_path = _destination(path, name, content_named)
    with AtomicWriter(directory, file_stem(name)) as writer:
        out = _TableFileWriter(writer.file, table.num_rows, table.mask.numel(), table.code_bits)
        out.write_payload(_as_bytes(table.payload[: _layout.payload_end(table)]))
        header_xxh3, file_bytes = out.finish(
            (
                table.num_rows,
                table.dim,
                table.row_bytes,
                table.unit_bytes,
                dtype_code(table.dtype, table.quant),
                table.chunk_bits,
            ),
            {
                SectionKind.MASK: table.mask,
                SectionKind.BITVAL: table.bitval,
                SectionKind.BLOCK_BASE: table.block_base,
                SectionKind.ROW_UNITS: table.row_units,
                SectionKind.BITMASK: table.bitmask,
            },
            _meta(name, table.quant, source, meta),
        )
        final = writer.commit(final_path(header_xxh3))
    written = _Written(
        table.num_rows,
        table.dim,
        table.dtype,
        table.quant,
        table.chunk_bits,
        table.unit_bytes,
        table.mask.numel(),
        table.code_bits,
        table.payload_bytes,
        header_xxh3,
        file_bytes,
    )
    return written.summary(name, final, time.perf_counter() - start)


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
    computed = xxhash.xxh3_64_intdigest(bytes(data[:_HEADER_HASHED]))
    if computed != header_xxh3:
        raise TableFileError(
            path,
            "header",
            f"checksum mismatch (stored {_hex(header_xxh3)}, computed {_hex(computed)})",
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
        or num_chunks != -(-row_bytes // (chunk_bits // 8))
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
            f"checksum mismatch (stored {_hex(header.sections_xxh3)}, computed {_hex(computed)})",
        )
    plan = _SectionPlan(header.num_rows, header.num_chunks, header.code_bits)
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
            kind is SectionKind.PAYLOAD and length < _layout.PAYLOAD_PAD
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
    blob = data[section.offset : section.offset + section.length]
    computed = xxhash.xxh3_64_intdigest(blob)
    if computed != section.xxh3:
        raise TableFileError(
            path,
            section.kind.label,
            f"checksum mismatch (stored {_hex(section.xxh3)}, computed {_hex(computed)})",
        )


def _check_gaps(path: Path, data: memoryview, sections: tuple[Section, ...]) -> None:
    """The alignment gaps must be zero: with them every byte of the file is checked, so no
    flipped byte anywhere goes unnoticed."""
    cursor = HEADER.size + SECTION.size * len(sections)
    for section in sections:
        if any(data[cursor : section.offset]):
            raise TableFileError(path, section.kind.label, "non-zero bytes in the gap before it")
        cursor = section.offset + section.length


def check_index(path: Path, table: CompressedTable) -> None:
    """Structural checks the decoder relies on, beyond the checksums: a valid, compact layout
    whose every slot lies inside the payload."""
    lengths = _layout.block_bytes(table.row_units, table.unit_bytes)
    starts = torch.cumsum(lengths, 0) - lengths
    if not torch.equal(table.block_base[:-1], starts) or int(table.block_base[-1]) != int(
        lengths.sum()
    ):
        raise TableFileError(path, "block_base", "block offsets disagree with the row sizes")
    if int(table.block_base[-1]) + _layout.PAYLOAD_PAD != table.payload.numel():
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
    path: str | os.PathLike[str], *, verify: bool = False, prefetch: bool = False
) -> TableFile:
    """Map a table file and return its zero-copy table.

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
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(data)
    try:
        header = read_header(path, view, size)
        sections = read_sections(path, view, header)
        by_kind = {s.kind: s for s in sections}
        _check_gaps(path, view, sections)
        for kind in _INDEX_KINDS:
            _check_section(path, view, by_kind[kind])
        if verify:
            _check_section(path, view, by_kind[SectionKind.PAYLOAD])
        elif prefetch:
            _prefetch(data, by_kind[SectionKind.PAYLOAD])
        meta_section = by_kind[SectionKind.META]
        try:
            meta = json.loads(
                bytes(view[meta_section.offset : meta_section.offset + meta_section.length])
            )
        except ValueError as exc:
            raise TableFileError(path, "meta", f"not valid JSON: {exc}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise TableFileError(path, "meta", "expected a JSON object with a 'name'")
        quant = "int8_rowwise" if header.dtype_code == INT8_ROWWISE_CODE else None
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
            dtype=torch.uint8 if quant else _DTYPES_BY_CODE[header.dtype_code],
            unit_bytes=header.unit_bytes,
            quant=quant,
        )
        check_index(path, table)
    finally:
        view.release()  # the tensors hold their own references to the mapping
    return TableFile(path=path, header=header, sections=sections, meta=meta, table=table)


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
        computed = _hex(decoded_xxh3(loaded.table))
    except (RuntimeError, ValueError) as exc:  # the codec rejects what it cannot decode
        raise TableFileError(path, "payload", f"decode failed: {exc}") from None
    if computed != expected:
        raise TableFileError(
            path, "payload", f"decoded rows hash to {computed}, the source hashed to {expected}"
        )
    return loaded
