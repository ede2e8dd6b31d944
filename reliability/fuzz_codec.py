# SPDX-License-Identifier: Apache-2.0
"""Codec fuzz: millions of small tables round-tripped bit for bit through the C++ codec.

    python -m reliability.fuzz_codec --cases 1000000 [--jobs 2] [--seed 0] [--json PATH]

A *case* is one small table (1 to ~130 rows) of fp32, fp16, bf16 or uint8 rows whose bits follow
one edge-case distribution: NaNs with payloads, signed zeros, infinities, subnormals, rows that
are almost invariant, single outliers, random bits, trained-like values. Calling the ops once
per tiny table would time the dispatcher, not the codec, so cases are batched: the tables of one
batch share dtype and row width and are stacked into one tensor, and one ``ibp_fit`` /
``ibp_compress`` / ``ibp_decompress`` / ``ibp_gather`` call handles them all (and one more
gather reads a random half of the rows from a hot-row overlay; float batches also pool repeated
ids with SUM, bit for bit against the same rows stored raw, which exercises the per-call cache
of decoded rows that spares repeated ids their decode). The masks are
fitted on the whole stack or on one member table (so the other members are mostly exceptions
and raw rows), or are a fit with random bits flipped and a random bitval (pairs no fit produces,
next to chunks that still participate), or are empty (the raw path). Every fit method, chunk
width, code width and alignment is drawn: code width C = 1 is plain IBP (one pattern per chunk
position); C = 2..4 are format.h's exponent-aware codebooks of 2^C - 1 patterns per position,
fitted ones (``ibp_fit(..., code_bits)``) and random ones inside perturbed masks (duplicate
entries, patterns no row has, patterns taken from rows).

Two more checks run on a sample of the cases: each alone through ``ibpembed.compress`` (its own
fit, chunk and code width chosen by the codec or forced), and each against the independent numpy
reference (``ibpembed.reference``: same masks and codebooks, same payload bytes, same rows; for
fitted or perturbed codebooks).

Batches cycle through the decoders the CPU runs, switched in process: every CPU path
(``avx512`` / ``bmi2`` / ``ref``), and the ``avx512`` path with each of its pattern lookups
(``gather`` / ``tables``), so every job fuzzes all of them. A mismatch is saved (``--failures
DIR``) with the command that replays its batch (on the same decoder); the exit status is 1 if
any case failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ibpembed import _C, codec
from ibpembed import reference as ref
from ibpembed._ops import ops

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
# (exponent bits, mantissa bits) of each float dtype's bit layout.
FLOAT_LAYOUT = {torch.float32: (8, 23), torch.float16: (5, 10), torch.bfloat16: (8, 7)}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
# Element counts per row: 1, odd, one either side of every chunk size and block-ish size, wide.
DIMS = (
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    15,
    16,
    17,
    24,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    96,
    127,
    128,
    129,
    255,
    256,
    257,
    384,
    513,
)
# Rows this wide need a slot unit above the alignment (> 255 units of 8 bytes): drawn rarely.
WIDE_DIMS = (1024, 3000, 4100)
KINDS = (
    "trained",
    "bf16_rounded",
    "edge",
    "nan_payloads",
    "subnormals",
    "zeros_infs",
    "identical",
    "near_invariant",
    "single_outlier",
    "outlier_row",
    "random_bits",
    "mixed",
    "constant_bytes",
    "low_entropy",
    "int8_rowwise",
)
FIT_SOURCES = ("stack", "member", "perturbed_fit", "raw")
ALIGNS = (1, 8, 16, 32)
CHUNK_BITS = (16, 32, 64)
# Code widths C (format.h): 1 is plain IBP, 2..4 the codebook mode. Half the batches take C > 1.
CODE_BITS = (1, 2, 3, 4)
CODE_BITS_P = (0.5, 0.5 / 3, 0.5 / 3, 0.5 / 3)
BATCH_BYTES = 1 << 17  # rows bytes per batch: large enough to amortise each op call
MAX_TABLES_PER_BATCH = 256


@dataclass
class Batch:
    """One op call's worth of cases: tables of one dtype and width, and how to encode them."""

    dtype: torch.dtype
    dim: int
    tables: list[torch.Tensor]  # each [rows_i, dim] of dtype
    kinds: list[str]
    chunk_bits: int
    align: int
    fit_source: str
    method: str  # ibp_fit method for the "stack" and "member" sources
    code_bits: int = 1  # C: bitval holds V * (2^C - 1) codebook entries


@dataclass
class Stats:
    """What one job did; summed over jobs for the report."""

    cases: int = 0
    rows: int = 0
    row_bytes: int = 0
    batches: int = 0
    op_calls: int = 0
    compressed_rows: int = 0
    solo_cases: int = 0
    reference_cases: int = 0
    mismatches: list[dict] = field(default_factory=list)
    by_dtype: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    by_chunk_bits: Counter = field(default_factory=Counter)
    by_code_bits: Counter = field(default_factory=Counter)
    by_fit_source: Counter = field(default_factory=Counter)
    by_cpu_path: Counter = field(default_factory=Counter)

    def merge(self, other: Stats) -> None:
        for name in (
            "cases",
            "rows",
            "row_bytes",
            "batches",
            "op_calls",
            "compressed_rows",
            "solo_cases",
            "reference_cases",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.mismatches += other.mismatches
        for name in (
            "by_dtype",
            "by_kind",
            "by_chunk_bits",
            "by_code_bits",
            "by_fit_source",
            "by_cpu_path",
        ):
            getattr(self, name).update(getattr(other, name))


# -- value distributions -------------------------------------------------------------------------
def _float_bits(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    exponent: np.ndarray | int | None = None,
    mantissa: np.ndarray | None = None,
) -> np.ndarray:
    """Bit patterns with a random sign and the given (or random) exponent and mantissa fields."""
    e_bits, m_bits = FLOAT_LAYOUT[dtype]
    uint = UINT[dtype.itemsize]
    sign = rng.integers(0, 2, shape, dtype=np.uint64)
    if exponent is None:
        exponent = rng.integers(0, 1 << e_bits, shape, dtype=np.uint64)
    if mantissa is None:
        mantissa = rng.integers(0, 1 << m_bits, shape, dtype=np.uint64)
    bits = (sign << np.uint64(e_bits + m_bits)) | (np.uint64(exponent) << np.uint64(m_bits))
    return (bits | mantissa.astype(np.uint64)).astype(uint)


def _from_values(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 values rounded to ``dtype`` (torch does the bf16 rounding numpy cannot), as bits."""
    uint = UINT[dtype.itemsize]
    if dtype == torch.uint8:
        return np.clip(np.rint(values * 1000.0 + 128.0), 0, 255).astype(np.uint8)
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
    view = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    return t.view(view).numpy().view(uint)


def _edge_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """Signed zeros, infinities, NaNs with payloads, extreme subnormals and finite values, 1.0."""
    uint = UINT[dtype.itemsize]
    if dtype == torch.uint8:
        return rng.choice(np.array([0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF], np.uint8), shape)
    e_bits, m_bits = FLOAT_LAYOUT[dtype]
    top, m_all = (1 << e_bits) - 1, (1 << m_bits) - 1
    sign = 1 << (e_bits + m_bits)
    one = ((1 << (e_bits - 1)) - 1) << m_bits
    inf = top << m_bits
    patterns = [0, sign, inf, sign | inf, inf | 1, inf | m_all, sign | inf | (1 << (m_bits - 1)),
                1, m_all, sign | 1, sign | m_all, inf - 1, sign | (inf - 1), one, sign | one,
                1 << m_bits]  # fmt: skip
    return rng.choice(np.array(patterns, dtype=uint), shape)


def make_values(
    rng: np.random.Generator, kind: str, dtype: torch.dtype, rows: int, dim: int
) -> np.ndarray:
    """[rows, dim] bit patterns (unsigned ints of the dtype's width) following ``kind``."""
    shape = (rows, dim)
    uint = UINT[dtype.itemsize]
    full = (1 << (8 * dtype.itemsize)) - 1
    is_float = dtype in FLOAT_LAYOUT
    if kind in ("trained", "single_outlier", "outlier_row", "bf16_rounded"):
        sigma = 10.0 ** rng.uniform(-5, 0.5)
        values = rng.normal(0.0, sigma, shape).astype(np.float32)
        values[rng.random(rows) < rng.uniform(0, 0.2)] = 0.0  # never-trained rows
        bits = _from_values(values, dtype)
        if kind == "bf16_rounded" and dtype == torch.float32:
            bits &= np.uint32(0xFFFF0000)
        elif kind == "single_outlier":
            outlier = _edge_bits(rng, (1,), dtype)[0]
            if rng.random() < 0.5:
                outlier = uint(rng.integers(0, full + 1, dtype=np.uint64))
            bits[rng.integers(rows), rng.integers(dim)] = outlier
        elif kind == "outlier_row":
            bits[rng.integers(rows)] = rng.integers(0, full + 1, dim, dtype=np.uint64)
        return bits
    if kind == "edge":
        return _edge_bits(rng, shape, dtype)
    if kind == "nan_payloads" and is_float:
        e_bits, m_bits = FLOAT_LAYOUT[dtype]
        mantissa = rng.integers(1, 1 << m_bits, shape, dtype=np.uint64)
        return _float_bits(rng, shape, dtype, exponent=(1 << e_bits) - 1, mantissa=mantissa)
    if kind == "subnormals" and is_float:
        return _float_bits(rng, shape, dtype, exponent=0)
    if kind == "zeros_infs" and is_float:
        e_bits, _ = FLOAT_LAYOUT[dtype]
        exponent = rng.choice(np.array([0, (1 << e_bits) - 1], np.uint64), shape)
        return _float_bits(
            rng, shape, dtype, exponent=exponent, mantissa=np.zeros(shape, np.uint64)
        )
    if kind in ("identical", "near_invariant"):
        base = rng.integers(0, full + 1, (1, dim), dtype=np.uint64).astype(uint)
        bits = np.repeat(base, rows, axis=0)
        if kind == "near_invariant":
            flip = rng.random(shape) < 10.0 ** rng.uniform(-3, -0.5)
            which = rng.integers(0, 8 * dtype.itemsize, shape).astype(uint)
            bits ^= np.where(flip, uint(1) << which, uint(0)).astype(uint)
        return bits
    if kind == "mixed":
        pick = rng.integers(0, 4, shape)
        choices = [
            make_values(rng, k, dtype, rows, dim)
            for k in ("trained", "edge", "nan_payloads", "subnormals")
        ]
        return np.choose(pick, choices).astype(uint)
    if kind == "constant_bytes":
        return np.full(shape, full if rng.random() < 0.5 else 0, dtype=uint)
    if kind == "low_entropy":
        return rng.integers(
            0, 1 << int(rng.integers(1, 8 * dtype.itemsize)), shape, dtype=np.uint64
        ).astype(uint)
    if kind == "int8_rowwise" and dtype == torch.uint8 and dim > 4:
        scale_bias = np.stack([rng.uniform(1e-3, 1e-2, rows), rng.uniform(-0.5, 0, rows)], 1)
        codes = rng.integers(0, 256, (rows, dim - 4), dtype=np.uint8)
        return np.concatenate([scale_bias.astype(np.float16).view(np.uint8), codes], axis=1)
    # random_bits, and the float-only kinds drawn for uint8 (or int8_rowwise on narrow rows).
    return rng.integers(0, full + 1, shape, dtype=np.uint64).astype(uint)


def as_table(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns [rows, dim] as a contiguous tensor of ``dtype`` (no value conversion)."""
    rows, dim = bits.shape
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).reshape(rows, -1).copy())
    return raw.view(dtype).reshape(rows, dim)


def table_rows(rng: np.random.Generator) -> int:
    """Row count of one case: mostly tiny (the fit's corner cases), sometimes past a block."""
    u = rng.random()
    if u < 0.35:
        return int(rng.integers(1, 5))
    if u < 0.85:
        return int(rng.integers(5, 33))
    return int(rng.integers(33, 131))


def make_batch(seed: int) -> Batch:
    """The batch drawn from ``seed`` (the replay key: same seed, same batch)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    dim = int(rng.choice(WIDE_DIMS if rng.random() < 0.01 else DIMS))
    row_bytes = dim * dtype.itemsize
    budget = max(1, BATCH_BYTES // row_bytes)
    sizes = []
    while sum(sizes) < budget and len(sizes) < MAX_TABLES_PER_BATCH:
        sizes.append(table_rows(rng))
    mode = rng.integers(3)
    if mode == 0:
        # Coherent: one distribution with one set of parameters, cut into small tables, so a
        # fit on the stack finds real invariant bits and most rows take the decoder's path.
        kind = KINDS[int(rng.integers(len(KINDS)))]
        whole = as_table(make_values(rng, kind, dtype, sum(sizes), dim), dtype)
        tables, kinds = list(torch.split(whole, sizes)), [kind] * len(sizes)
    else:
        # One kind with its own parameters per table (mode 1), or any kind per table (mode 2).
        one_kind = KINDS[int(rng.integers(len(KINDS)))] if mode == 1 else None
        kinds = [one_kind or KINDS[int(rng.integers(len(KINDS)))] for _ in sizes]
        tables = [
            as_table(make_values(rng, k, dtype, n, dim), dtype)
            for k, n in zip(kinds, sizes, strict=True)
        ]
    weights = np.array([0.35, 0.35, 0.2, 0.1])
    chunk_bits = int(rng.choice(CHUNK_BITS))
    align = int(rng.choice(ALIGNS, p=[0.4, 0.4, 0.1, 0.1]))
    fit_source = str(rng.choice(FIT_SOURCES, p=weights))
    paper = rng.random() < 0.25
    code_bits = int(rng.choice(CODE_BITS, p=CODE_BITS_P))
    return Batch(
        dtype=dtype,
        dim=dim,
        tables=tables,
        kinds=kinds,
        chunk_bits=chunk_bits,
        align=align,
        fit_source=fit_source,
        # The paper's fit has no codebooks: C > 1 always fits with "ibpembed".
        method="paper" if paper and code_bits == 1 else "ibpembed",
        code_bits=code_bits,
    )


def u8_rows(table: torch.Tensor) -> torch.Tensor:
    return table.view(torch.uint8).reshape(table.shape[0], -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), shapes and dtypes too."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def perturbed_masks(
    rows: torch.Tensor, chunk_bits: int, code_bits: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fit of ``rows`` with random bits added and dropped per position, and a codebook inside
    the new masks, so rows meet mask/pattern pairs no fit would produce while many chunks still
    match a pattern (escapes next to coded chunks).

    Each of the K codebook slots is filled for all positions at once from one source: a random
    row's chunks (they match at least that row), random bits, or (C > 1) the fitted entry of
    that slot; all masked to the new masks, so entries may repeat and may match nothing.
    """
    v = -(-rows.shape[1] // (chunk_bits // 8))
    k = ref.codebook_size(code_bits)
    fitted, fitted_book = ops.ibp_fit(rows, chunk_bits, "ibpembed", code_bits)
    flips = rng.random((v, chunk_bits)) < rng.uniform(0, 0.3, (v, 1))
    weights = np.uint64(1) << np.arange(chunk_bits, dtype=np.uint64)
    mask = fitted.numpy().view(np.uint64) ^ (flips * weights).sum(1, dtype=np.uint64)
    fitted_book = fitted_book.numpy().view(np.uint64).reshape(v, k)
    book = np.zeros((v, k), dtype=np.uint64)
    for slot in range(k):
        u = rng.random()
        if u < 0.7:
            padded = np.zeros(v * chunk_bits // 8, np.uint8)
            row = rows[int(rng.integers(rows.shape[0]))].numpy()
            padded[: row.size] = row
            source = padded.view({16: np.uint16, 32: np.uint32, 64: np.uint64}[chunk_bits])
            book[:, slot] = source.astype(np.uint64) & mask
        elif code_bits == 1 or u < 0.85:
            top = (1 << chunk_bits) - 1
            book[:, slot] = rng.integers(0, top, v, dtype=np.uint64, endpoint=True) & mask
        else:
            book[:, slot] = fitted_book[:, slot] & mask
    return _as_int64_tensor(mask), _as_int64_tensor(book.reshape(-1))


def _as_int64_tensor(bits: np.ndarray) -> torch.Tensor:
    """uint64 bit patterns as the int64 tensor the ops take."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int64).copy())


def batch_masks(
    batch: Batch, stack: torch.Tensor, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, bitval) for the stacked rows, from the batch's fit source; bitval holds the
    V * (2^C - 1) codebook entries."""
    v = -(-stack.shape[1] // (batch.chunk_bits // 8))
    c = batch.code_bits
    if batch.fit_source == "stack":
        return ops.ibp_fit(stack, batch.chunk_bits, batch.method, c)
    if batch.fit_source == "member":
        member = batch.tables[int(rng.integers(len(batch.tables)))]
        return ops.ibp_fit(u8_rows(member), batch.chunk_bits, batch.method, c)
    if batch.fit_source == "raw":
        return torch.zeros(v, dtype=torch.int64), torch.zeros(
            v * ref.codebook_size(c), dtype=torch.int64
        )
    return perturbed_masks(stack, batch.chunk_bits, c, rng)


# -- checks ----------------------------------------------------------------------------------------
def check_batch(batch: Batch, seed: int) -> tuple[list[str], int, int]:
    """Stacked round trip: (problems, compressed rows, op calls)."""
    rng = np.random.default_rng([seed, 1])
    table = torch.cat(batch.tables)
    stack = u8_rows(table)
    n, row_bytes = stack.shape
    mask, bitval = batch_masks(batch, stack, rng)
    unit = codec.slot_unit_bytes(row_bytes, batch.align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(
        stack, batch.chunk_bits, mask, bitval, unit
    )
    # The stack as one table of uint8 rows (check_pooled reads it as the batch's dtype).
    whole = codec.CompressedTable(
        payload, block_base, row_units, bitmask, mask, bitval,
        chunk_bits=batch.chunk_bits, num_rows=n, dim=row_bytes, dtype=torch.uint8, unit_bytes=unit,
    )  # fmt: skip
    args = whole.op_args()
    problems = []
    if not torch.equal(ops.ibp_decompress(*args), stack):
        problems.append("decompress")
    ids = torch.from_numpy(rng.integers(0, n, int(rng.integers(1, 2 * n + 1))))
    if not torch.equal(ops.ibp_gather(*args, ids), stack[ids]):
        problems.append("gather")
    # The same gather with a random half of the rows read from a hot-row overlay.
    hot = whole.with_hot_rows(torch.from_numpy(np.flatnonzero(rng.random(n) < 0.5)))
    if not torch.equal(hot.gather(ids), stack[ids]):
        problems.append("hot-row gather")
    slots = ops.ibp_slot_bytes(stack, batch.chunk_bits, mask, bitval, unit)
    if not torch.equal(slots, row_units[:n].to(torch.int64) * unit):
        problems.append("slot_bytes")
    calls = 6 + (batch.fit_source != "raw")
    if batch.dtype != torch.uint8:
        problems += check_pooled(batch, stack, whole, rng)
        calls += 3
    compressed = int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum())
    return problems, compressed, calls


def check_pooled(
    batch: Batch, stack: torch.Tensor, whole: codec.CompressedTable, rng: np.random.Generator
) -> list[str]:
    """Pooled SUM over repeated ids (each thread's repeat cache in play) gives the bits of the
    same rows stored raw: same rows, same order, so NaN payloads and -0.0 included. ``whole``:
    the stack compressed, as uint8 rows."""
    n = stack.shape[0]
    ours = replace(whole, dim=batch.dim, dtype=batch.dtype)
    raw = codec.compress(stack.view(batch.dtype).view(n, batch.dim), method="raw")
    ids = torch.from_numpy(rng.integers(0, n, int(rng.integers(2, 4 * n + 3))))
    cuts = np.sort(rng.integers(0, ids.numel() + 1, int(rng.integers(0, 20))))
    offsets = torch.from_numpy(np.concatenate([[0], cuts, [ids.numel()]]))
    got, want = ours.lookup(ids, offsets), raw.lookup(ids, offsets)
    return [] if torch.equal(got.view(torch.int32), want.view(torch.int32)) else ["pooled sum"]


def check_solo(table: torch.Tensor, rng: np.random.Generator) -> list[str]:
    """One case alone through the public API: its own fit and (usually) its own chunk width."""
    method = str(rng.choice(("ibpembed", "ibpembed", "paper", "raw")))
    chunk_bits = None if rng.random() < 0.6 else int(rng.choice(CHUNK_BITS))
    # The codec's own choice of code width, or a forced one (codebooks need "ibpembed").
    code_bits = None
    if method == "ibpembed" and rng.random() < 0.5:
        code_bits = int(rng.choice(CODE_BITS))
    align = int(rng.choice(ALIGNS))
    c = codec.compress(
        table, method=method, chunk_bits=chunk_bits, code_bits=code_bits, align=align
    )
    problems = [] if same_bits(c.decompress(), table) else ["solo decompress"]
    if code_bits is not None and c.code_bits != code_bits:
        problems.append(f"solo code_bits {c.code_bits} != {code_bits}")
    ids = torch.from_numpy(rng.integers(0, table.shape[0], 2 * table.shape[0]))
    if not same_bits(c.gather(ids), table[ids]):
        problems.append("solo gather")
    return problems


def check_reference(table: torch.Tensor, rng: np.random.Generator) -> list[str]:
    """One case against the numpy reference: masks and codebooks, payload, index and rows
    identical. The bytes are compared for the fit or (one case in three) a perturbed one."""
    rows = u8_rows(table)
    npy = rows.numpy()
    bits = int(rng.choice(CHUNK_BITS))
    code_bits = int(rng.choice(CODE_BITS, p=CODE_BITS_P))
    method = "paper" if code_bits == 1 and rng.random() < 0.3 else "ibpembed"
    align = int(rng.choice(ALIGNS))
    mask, bitval = ops.ibp_fit(rows, bits, method, code_bits)
    if code_bits > 1:
        ref_mask, ref_bitval = ref.fit_codebooks(npy, bits, code_bits)
    else:
        ref_mask, ref_bitval = (ref.fit_paper if method == "paper" else ref.fit_greedy)(npy, bits)
    problems = []
    if not (
        np.array_equal(mask.numpy().view(np.uint64), ref_mask)
        and np.array_equal(bitval.numpy().view(np.uint64), ref_bitval)
    ):
        problems.append(f"reference fit ({method}, W={bits}, C={code_bits})")
    source = "fit"
    if rng.random() < 1 / 3:
        mask, bitval = perturbed_masks(rows, bits, code_bits, rng)
        source = "perturbed"
    unit = codec.slot_unit_bytes(npy.shape[1], align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(rows, bits, mask, bitval, unit)
    expected = ref.compress(
        npy,
        bits,
        mask.numpy().view(np.uint64),
        bitval.numpy().view(np.uint64),
        align,
        code_bits,
    )
    same = (
        np.array_equal(payload.numpy(), expected.payload)
        and np.array_equal(block_base.numpy(), expected.block_base)
        and np.array_equal(row_units.numpy(), expected.row_units)
        and np.array_equal(bitmask.numpy().view(np.uint32), expected.bitmask)
    )
    if not same:
        problems.append(f"reference bytes (W={bits}, C={code_bits}, {source}, align={align})")
    if not np.array_equal(ref.decompress(expected), npy):
        problems.append("reference decode")
    return problems


# -- driver ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobPlan:
    """What one worker process runs."""

    job: int
    jobs: int
    seed: int
    cases: int  # this job's share
    solo_every: int  # every n-th case also runs alone (0 = never)
    reference_every: int  # every n-th batch checks one small case against the reference
    failures: str | None


def batch_seed(seed: int, index: int) -> int:
    """The seed of global batch ``index`` (what ``--batch`` replays)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def decoders() -> list[tuple[str, str]]:
    """(CPU path, pattern lookup) of every decoder this CPU runs; the lookup only matters to
    the avx512 path."""
    out = []
    for path in codec.available_cpu_paths():
        lookups = ("gather", "tables") if path == "avx512" else (_C.default_pattern_lookup(),)
        out += [(path, lookup) for lookup in lookups]
    return out


@contextmanager
def batch_decoder(index: int) -> Iterator[str]:
    """This process on batch ``index``'s decoder while the batch runs; yields its name."""
    every = decoders()
    path, lookup = every[index % len(every)]
    before = _C.cpu_path(), _C.pattern_lookup()
    _C.set_cpu_path(path)
    _C.set_pattern_lookup(lookup)
    try:
        yield f"{path}/{lookup}" if path == "avx512" else path
    finally:
        _C.set_cpu_path(before[0])
        _C.set_pattern_lookup(before[1])


def run_job(plan: JobPlan, on_batch: Callable[[Stats], None] | None = None) -> Stats:
    """Run batches ``job, job + jobs, ...`` until this job's share of cases is done."""
    torch.set_num_threads(1)  # parallelism comes from the jobs; threads would oversubscribe
    stats = Stats()
    b = 0
    while stats.cases < plan.cases:
        run_batch(plan, b * plan.jobs + plan.job, stats)
        b += 1
        if on_batch is not None:
            on_batch(stats)
    return stats


def run_batch(plan: JobPlan, index: int, stats: Stats) -> None:
    """Build batch ``index``, run every check on it with its decoder, add to ``stats``."""
    with batch_decoder(index) as path:
        _run_batch(plan, index, stats, path)


def _run_batch(plan: JobPlan, index: int, stats: Stats, path: str) -> None:
    seed = batch_seed(plan.seed, index)
    batch = make_batch(seed)
    problems, compressed, calls = check_batch(batch, seed)
    rng = np.random.default_rng([seed, 2])
    for i, table in enumerate(batch.tables):
        if plan.solo_every and (stats.cases + i) % plan.solo_every == 0:
            problems += check_solo(table, rng)
            stats.solo_cases += 1
    if plan.reference_every and stats.batches % plan.reference_every == 0:
        small = [t for t in batch.tables if t.shape[0] <= 40 and t.shape[1] * t.itemsize <= 160]
        if small:
            problems += check_reference(small[int(rng.integers(len(small)))], rng)
            stats.reference_cases += 1
    n = sum(t.shape[0] for t in batch.tables)
    stats.cases += len(batch.tables)
    stats.rows += n
    stats.row_bytes += n * batch.dim * batch.dtype.itemsize
    stats.batches += 1
    stats.op_calls += calls
    stats.compressed_rows += compressed
    stats.by_dtype[str(batch.dtype).removeprefix("torch.")] += len(batch.tables)
    stats.by_kind.update(batch.kinds)
    stats.by_chunk_bits[str(batch.chunk_bits)] += len(batch.tables)
    stats.by_code_bits[str(batch.code_bits)] += len(batch.tables)
    stats.by_fit_source[batch.fit_source] += len(batch.tables)
    stats.by_cpu_path[path] += len(batch.tables)
    if problems:
        stats.mismatches.append(_record(plan, index, batch, problems, path))


def _record(plan: JobPlan, index: int, batch: Batch, problems: list[str], path: str) -> dict:
    replay = f"python -m reliability.fuzz_codec --seed {plan.seed} --batch {index}"
    entry = {
        "batch": index,
        "problems": problems,
        "cpu_path": path,
        "replay": replay,
        "dtype": str(batch.dtype),
        "dim": batch.dim,
        "chunk_bits": batch.chunk_bits,
        "code_bits": batch.code_bits,
        "align": batch.align,
        "fit_source": batch.fit_source,
        "method": batch.method,
    }
    if plan.failures:
        out = Path(plan.failures)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"tables": batch.tables, **entry}, out / f"batch_{index}.pt")
    print(f"MISMATCH batch {index}: {problems}; replay: {replay}", file=sys.stderr, flush=True)
    return entry


def _worker(plan: JobPlan, out: mp.Queue) -> None:
    out.put(run_job(plan))


def run(
    cases: int, jobs: int, seed: int, solo_every: int, reference_every: int, failures: str | None
) -> tuple[Stats, float]:
    """Run ``cases`` cases over ``jobs`` processes; (merged stats, seconds)."""
    started = time.perf_counter()
    plans = [
        JobPlan(
            j, jobs, seed, cases // jobs + (j < cases % jobs), solo_every, reference_every, failures
        )
        for j in range(jobs)
    ]
    if jobs == 1:
        return run_job(plans[0]), time.perf_counter() - started
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for plan in plans:
        proc = ctx.Process(target=_worker, args=(plan, queue))
        proc.start()
        procs.append(proc)
    total = Stats()
    for _ in procs:
        total.merge(queue.get())
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"fuzz job exited with {proc.exitcode}")
    return total, time.perf_counter() - started


def report(stats: Stats, seconds: float, args: argparse.Namespace) -> dict:
    """The JSON summary (what reliability/README.md quotes)."""
    return {
        "command": "python -m reliability.fuzz_codec " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "jobs": args.jobs,
        "seconds": round(seconds, 1),
        "cases": stats.cases,
        "rows": stats.rows,
        "row_bytes": stats.row_bytes,
        "batches": stats.batches,
        "op_calls": stats.op_calls,
        "compressed_rows": stats.compressed_rows,
        "solo_cases": stats.solo_cases,
        "reference_cases": stats.reference_cases,
        "mismatches": len(stats.mismatches),
        "failures": stats.mismatches,
        "by_dtype": dict(stats.by_dtype),
        "by_kind": dict(stats.by_kind),
        "by_chunk_bits": dict(stats.by_chunk_bits),
        "by_code_bits": dict(stats.by_code_bits),
        "by_fit_source": dict(stats.by_fit_source),
        "by_cpu_path": dict(stats.by_cpu_path),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1_000_000, help="small tables to round-trip")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--solo-every",
        type=int,
        default=50,
        help="every n-th case also runs alone through ibpembed.compress (0 = off)",
    )
    p.add_argument(
        "--reference-every",
        type=int,
        default=4,
        help="every n-th batch checks one small case against ibpembed.reference",
    )
    p.add_argument("--batch", type=int, help="replay this one batch (from a mismatch report)")
    p.add_argument("--failures", help="save failing batches here (.pt)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    if args.batch is not None:
        plan = JobPlan(0, 1, args.seed, 1, 1, 1, args.failures)
        stats = Stats()
        run_batch(plan, args.batch, stats)
        print("mismatch" if stats.mismatches else "ok", stats.cases, "cases")
        return 1 if stats.mismatches else 0
    stats, seconds = run(
        args.cases, args.jobs, args.seed, args.solo_every, args.reference_every, args.failures
    )
    summary = report(stats, seconds, args)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if stats.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
