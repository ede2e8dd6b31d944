# SPDX-License-Identifier: Apache-2.0
"""Write ``.ibpt`` table files: stream-compress a source into one, or write a compressed table.

>>> info = pack_table("user.ibpt", weight, name="user")    # compress + write, streaming

Writers are atomic (:class:`ibpembed.tables.atomic.AtomicWriter`): a crash at any moment leaves
either the old file or the new one under the final name, never a mix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from ibpembed import codec, layout
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable
from ibpembed.tables import _layout
from ibpembed.tables.atomic import AtomicWriter
from ibpembed.tables.format import (
    HEADER,
    HEADER_HASHED,
    LAYOUT_VERSION,
    MAGIC,
    SECTION,
    SUFFIX,
    VERSION,
    SectionKind,
    SectionPlan,
    as_bytes,
    decoded_xxh3,
    dtype_code,
    dtype_name,
    file_stem,
    hex64,
    row_steps,
)

# Bytes of source rows compressed per step while packing: bounds pack memory to the source
# plus about this much, whatever the table size.
PACK_STEP_BYTES = 64 << 20


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
        return layout.savings(self.stored_bytes, self.raw_bytes)


# -- writing ---------------------------------------------------------------------------------


class _TableFileWriter:
    """Writes one table file into an open binary file: payload streamed first, index last."""

    def __init__(self, file: BinaryIO, num_rows: int, num_chunks: int, code_bits: int) -> None:
        self.file = file
        self.code_bits = code_bits
        self.plan = SectionPlan(num_rows, num_chunks, code_bits)
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
        self.write_payload(memoryview(bytes(layout.PAYLOAD_PAD)))
        meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        file_bytes = self.plan.place_tail(self.payload_bytes, len(meta_bytes))
        hashes = {SectionKind.PAYLOAD: self.payload_hash.intdigest()}
        blobs: dict[SectionKind, memoryview] = {k: as_bytes(t) for k, t in index.items()}
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
        header_xxh3 = xxhash.xxh3_64_intdigest(head[:HEADER_HASHED])
        self.file.seek(0)
        self.file.write(head[:HEADER_HASHED] + struct.pack("<Q", header_xxh3) + table)
        return header_xxh3, file_bytes


def _meta(name: str, quant: str | None, source_xxh3: int, extra: Mapping[str, Any] | None) -> dict:
    meta: dict[str, Any] = dict(extra or {})
    meta.update(name=name, quant=quant, source_xxh3=hex64(source_xxh3))
    return meta


def _pack_into(
    file: BinaryIO,
    weight: torch.Tensor,
    *,
    name: str,
    fit: codec.FitOptions,
    meta: Mapping[str, Any] | None,
    progress: Callable[[int], None] | None,
) -> _Written:
    """Fit on a sample, then compress and write step by step."""
    # The same sample and fit as codec.compress, so the file holds exactly its bytes.
    fitted = codec.fit_table(weight, fit)
    quant = fit.quant
    num_rows, dim = weight.shape
    rows = weight.view(torch.uint8).view(num_rows, -1)
    row_bytes = rows.shape[1]
    bits, mask, bitval, unit = fitted.chunk_bits, fitted.mask, fitted.bitval, fitted.unit_bytes
    blocks = layout.num_blocks(num_rows)
    block_base = torch.empty(blocks + 1, dtype=torch.int64)
    row_units = torch.zeros(blocks * layout.ROWS_PER_BLOCK, dtype=torch.uint8)
    bitmask = torch.zeros(layout.bitmask_words(num_rows), dtype=torch.int32)
    writer = _TableFileWriter(file, num_rows, mask.numel(), fitted.code_bits)
    source_hash = xxhash.xxh3_64()
    for begin, end in row_steps(num_rows, row_bytes, PACK_STEP_BYTES):
        step = rows[begin:end]
        source_hash.update(as_bytes(step))
        payload, base, units, compressed = ops.ibp_compress(step, bits, mask, bitval, unit)
        b0, nb = begin // layout.ROWS_PER_BLOCK, base.numel() - 1
        block_base[b0 : b0 + nb] = base[:-1] + writer.payload_bytes
        row_units[begin : begin + units.numel()] = units
        bitmask[b0 : b0 + compressed.numel()] = compressed
        writer.write_payload(as_bytes(payload[: int(base[-1])]))
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
    header_xxh3, file_bytes = writer.finish(
        (num_rows, dim, row_bytes, unit, dtype_code(weight.dtype, quant), bits),
        index,
        _meta(name, quant, source_hash.intdigest(), {**fit.meta(), **(meta or {})}),
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
            index_bytes=layout.index_bytes(self.num_rows),
            metadata_bytes=layout.metadata_bytes(self.num_rows, self.num_chunks, self.code_bits),
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
    fit: codec.FitOptions | None = None,
    meta: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    for_gpu: bool = False,
) -> PackedTable:
    """Compress ``weight`` and write it as one table file, atomically, in bounded memory.

    The fit sees a random row sample; rows are then compressed ``PACK_STEP_BYTES`` at a time and
    streamed to disk, so memory stays near the source size plus one step (the bytes equal those
    of ``codec.compress`` with the same ``fit``).

    Parameters
    ----------
    path : the target file; with ``content_named``, the directory to write
        ``<name>.<header checksum>.ibpt`` into (the files of a table set).
    weight : [N, D] contiguous CPU tensor (fp32/fp16/bf16/int8/uint8).
    name : table name recorded in the file.
    fit : how to fit it (``codec.FitOptions``; default: its defaults), as for ``codec.compress``.
    meta : extra JSON-serialisable fields for the meta section (features, pooling, origin).
    progress : called with the number of rows done after each step.
    for_gpu : lay the table out for a GPU's zero-copy reads (``gpu_layout.for_gpu``: slots on
        32-byte boundaries where that saves PCIe lines, or raw rows where compression would cost
        sectors), its decision in the meta's ``gpu_layout``. Compresses the table in memory.

    Returns
    -------
    PackedTable: sizes, checksum and wall time.
    """
    start = time.perf_counter()
    fit = fit or codec.FitOptions()
    if for_gpu:
        from ibpembed.tables import gpu_layout

        compressed = codec.compress(weight, fit=fit)
        # Raw rows have no codebooks: a forced code width applies to the compressed layout only.
        raw_fit = dataclasses.replace(fit, method="raw", code_bits=None)
        table, decision = gpu_layout.for_gpu(
            compressed, lambda: codec.compress(weight, fit=raw_fit)
        )
        packed = write_table(
            path,
            table,
            name=name,
            content_named=content_named,
            meta={**fit.meta(), **(meta or {}), "gpu_layout": decision},
        )
        if progress is not None:  # in one step: the whole table is compressed at once
            progress(table.num_rows)
        # The wall time of the whole pack, compression and layout included, as without for_gpu.
        return dataclasses.replace(packed, seconds=time.perf_counter() - start)
    directory, final_path = _destination(path, name, content_named)
    with AtomicWriter(directory, file_stem(name)) as writer:
        written = _pack_into(
            writer.file,
            weight,
            name=name,
            fit=fit,
            meta=meta,
            progress=progress,
        )
        final = writer.commit(final_path(written.header_xxh3))
    return written.summary(name, final, time.perf_counter() - start)


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
        out.write_payload(as_bytes(table.payload[: _layout.payload_end(table)]))
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
