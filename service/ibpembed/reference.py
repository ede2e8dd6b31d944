# SPDX-License-Identifier: Apache-2.0
"""Pure numpy/Python reference of the codec and the lookups: the test oracle.

Written for clarity, not speed (Python integers as bit streams, one row at a time), and
independent of the C++ code: it re-derives the layout from format.h's prose. The C++ codec must
produce byte-identical payloads, identical masks and identical rows; pooled lookups agree within
the tolerance that ``pooled_tolerance`` derives.

Format version 3: per table a code width C in 1..4 and K = 2^C - 1 patterns per chunk position,
``bitval`` a flat codebook of V * K entries (``bitval[j * K + k - 1]`` = pattern of code k at
position j). C = 1 is the published IBP layout (one invariant-bit pattern per position, code 1 =
the chunk participates), byte for byte the version 2 layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ibpembed.layout import PAYLOAD_PAD, ROWS_PER_BLOCK, num_blocks

MAX_UNITS_PER_ROW = 255
MAX_CODE_BITS = 4
# fit_codebooks: rows of the sample it looks at, and the most mask bits per position it tries.
CODEBOOK_FIT_ROWS = 65536
CODEBOOK_MAX_MASK_BITS = 16
CODEBOOK_RANK_ROWS = 4096
INT8_ROWWISE_HEADER_BYTES = 4
PAPER_THRESHOLDS: tuple[float, ...] = tuple(
    float(t)
    for t in np.cumsum([np.float32(0.70)] + [np.float32(0.05)] * 6, dtype=np.float32)
    if t <= np.float32(1.0)
)


@dataclass
class RefTable:
    payload: np.ndarray  # uint8, with PAYLOAD_PAD trailing zeros
    block_base: np.ndarray  # int64
    row_units: np.ndarray  # uint8
    bitmask: np.ndarray  # uint32
    mask: np.ndarray  # uint64 [V]
    bitval: np.ndarray  # uint64 [V * K], K = 2^code_bits - 1: the flat codebook
    chunk_bits: int
    row_bytes: int
    unit_bytes: int
    num_rows: int
    code_bits: int = 1


# -- chunks and bits -----------------------------------------------------------------------------
def num_chunks(row_bytes: int, chunk_bits: int) -> int:
    return -(-row_bytes // (chunk_bits // 8))


def chunks_of(row: bytes, chunk_bits: int) -> list[int]:
    """Little-endian W-bit chunks of one row, zero-padded to a whole number of chunks."""
    s = chunk_bits // 8
    padded = row + bytes(num_chunks(len(row), chunk_bits) * s - len(row))
    return [int.from_bytes(padded[i : i + s], "little") for i in range(0, len(padded), s)]


def extract(x: int, mask: int) -> int:
    """pext: the bits of x at mask's set positions, packed low, lowest first."""
    out, k = 0, 0
    for t in range(64):
        if (mask >> t) & 1:
            out |= ((x >> t) & 1) << k
            k += 1
    return out


def deposit(src: int, mask: int) -> int:
    """pdep: the low bits of src, spread to mask's set positions, lowest first."""
    out, k = 0, 0
    for t in range(64):
        if (mask >> t) & 1:
            out |= ((src >> k) & 1) << t
            k += 1
    return out


def codebook_size(code_bits: int) -> int:
    """K, the patterns per position of a C-bit code (code 0 is the escape)."""
    return (1 << code_bits) - 1


def code_bits_for(codebook_entries: int, v: int) -> int:
    """The code width C of a codebook of ``codebook_entries`` entries for V positions."""
    for c in range(1, MAX_CODE_BITS + 1):
        if codebook_entries == v * codebook_size(c):
            return c
    raise ValueError(f"a codebook of {codebook_entries} entries does not fit {v} positions")


def _resolve_code_bits(mask: np.ndarray, bitval: np.ndarray, code_bits: int | None) -> int:
    """``code_bits``, or the width the codebook length implies; checked against that length."""
    implied = code_bits_for(len(bitval), len(mask))
    if code_bits is not None and code_bits != implied:
        raise ValueError(f"code_bits={code_bits} but the codebook has {len(bitval)} entries")
    return implied


def chunk_code(x: int, m: int, patterns: list[int]) -> int:
    """Code of chunk x: the smallest k whose pattern matches x's masked bits, else 0 (escape)."""
    for k, pattern in enumerate(patterns, start=1):
        if x & m == pattern:
            return k
    return 0


def slot_unit_bytes(row_bytes: int, align: int) -> int:
    unit = 1
    while unit < align:
        unit *= 2
    while -(-row_bytes // unit) > MAX_UNITS_PER_ROW:
        unit *= 2
    return unit


# -- fit -----------------------------------------------------------------------------------------
def _bit_ones(rows: np.ndarray, chunk_bits: int) -> np.ndarray:
    """ones[j, t]: sample rows with bit t of chunk j set."""
    n, row_bytes = rows.shape
    v = num_chunks(row_bytes, chunk_bits)
    padded = np.zeros((n, v * chunk_bits // 8), dtype=np.uint8)
    padded[:, :row_bytes] = rows
    bits = np.unpackbits(padded, axis=1, bitorder="little")  # byte b bit t -> column 8b + t
    return bits.sum(axis=0, dtype=np.int64).reshape(v, chunk_bits)


def fit_greedy(rows: np.ndarray, chunk_bits: int) -> tuple[np.ndarray, np.ndarray]:
    n = rows.shape[0]
    ones = _bit_ones(rows, chunk_bits)
    chunks = [chunks_of(bytes(r), chunk_bits) for r in rows]
    masks, bitvals = [], []
    for j in range(ones.shape[0]):
        majority = sum(1 << t for t in range(chunk_bits) if 2 * ones[j, t] > n)
        agree = [max(c, n - c) for c in ones[j].tolist()]
        order = sorted(range(chunk_bits), key=lambda t: (-agree[t], t))
        best_k, best_saving = 0, 0
        for k in range(1, chunk_bits + 1):
            top = sum(1 << t for t in order[:k])
            matching = sum(1 for row in chunks if (row[j] ^ majority) & top == 0)
            if k * matching > best_saving:
                best_k, best_saving = k, k * matching
        mask = sum(1 << t for t in order[:best_k])
        masks.append(mask)
        bitvals.append(majority & mask)
    return np.array(masks, dtype=np.uint64), np.array(bitvals, dtype=np.uint64)


def fit_paper(rows: np.ndarray, chunk_bits: int) -> tuple[np.ndarray, np.ndarray]:
    n = rows.shape[0]
    ones = _bit_ones(rows, chunk_bits)
    v = ones.shape[0]
    chunks = [chunks_of(bytes(r), chunk_bits) for r in rows]
    best, best_net = None, -1
    for threshold in PAPER_THRESHOLDS:
        hi, lo = threshold * n, (1.0 - threshold) * n
        masks = [
            sum(1 << t for t in range(chunk_bits) if ones[j, t] > hi or ones[j, t] < lo)
            for j in range(v)
        ]
        bitvals = [sum(1 << t for t in range(chunk_bits) if ones[j, t] > hi) for j in range(v)]
        net = 0
        for row in chunks:
            saved = sum(
                bin(masks[j]).count("1") for j in range(v) if row[j] & masks[j] == bitvals[j]
            )
            net += saved - v if saved > v else 0
        if net > best_net:
            best, best_net = (masks, bitvals), net
    assert best is not None
    return np.array(best[0], dtype=np.uint64), np.array(best[1], dtype=np.uint64)


def rank_bits_conditional(chunks: np.ndarray, chunk_bits: int, depth: int) -> list[int]:
    """The first ``depth`` bits of a greedy ranking: each next bit is the one the bits already
    ranked predict best, i.e. with the largest sum over the chunks' current prefix patterns of
    that bit's majority count (ties: lower bit index)."""
    bits = ((chunks[:, None] >> np.arange(chunk_bits, dtype=np.uint64)) & np.uint64(1)).astype(
        np.int64
    )  # [n, W]
    group = np.zeros(len(chunks), dtype=np.int64)
    order: list[int] = []
    for _ in range(depth):
        groups = int(group.max()) + 1 if len(group) else 1
        ones = np.zeros((groups, chunk_bits), dtype=np.int64)
        np.add.at(ones, group, bits)
        sizes = np.bincount(group, minlength=groups)[:, None]
        score = np.maximum(ones, sizes - ones).sum(axis=0)
        score[order] = -1
        best = int(np.argmax(score))  # first maximum: the lowest bit index
        order.append(best)
        _, group = np.unique(group * 2 + bits[:, best], return_inverse=True)
        group = group.reshape(-1)
    return order


def fit_codebooks(
    rows: np.ndarray, chunk_bits: int, code_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exponent-aware fit: per position a mask and K = 2^C - 1 patterns of its bits.

    On the first min(n, 65536) rows, per chunk position j: rank the W bits with
    ``rank_bits_conditional`` (on the first 4096 rows); for s = 0 .. min(W, 16) take the s
    top-ranked bits as mask_s, count the row patterns x & mask_s, let covered_s be the sum of
    the K largest counts and cost_s = (W - s) * n + s * (n - covered_s) (the free bits every
    row stores plus the masked bits the escapes store); keep the s of least cost (ties:
    smallest s). The codebook is mask_s's patterns by count descending (ties: smaller pattern
    first), the first K, padded by repeating the first. (The codec fits C = 1 with fit_greedy
    or fit_paper instead.)
    """
    if not 1 <= code_bits <= MAX_CODE_BITS:
        raise ValueError(f"code_bits must be in 1..{MAX_CODE_BITS}, got {code_bits}")
    k = codebook_size(code_bits)
    rows = rows[:CODEBOOK_FIT_ROWS]
    n = rows.shape[0]
    v = num_chunks(rows.shape[1], chunk_bits)
    chunks = np.array([chunks_of(bytes(r), chunk_bits) for r in rows], dtype=np.uint64)
    chunks = chunks.reshape(n, v)
    depth = min(chunk_bits, CODEBOOK_MAX_MASK_BITS)
    masks, codebooks = [], []
    for j in range(v):
        order = rank_bits_conditional(chunks[:CODEBOOK_RANK_ROWS, j], chunk_bits, depth)
        best = None  # (cost, mask, patterns ordered by count desc then value asc)
        for s in range(min(chunk_bits, CODEBOOK_MAX_MASK_BITS) + 1):
            mask = sum(1 << t for t in order[:s])
            values, counts = np.unique(chunks[:, j] & np.uint64(mask), return_counts=True)
            by_count = np.lexsort((values, -counts))  # last key is primary
            patterns = [int(values[i]) for i in by_count]
            covered = int(counts[by_count[:k]].sum())
            cost = (chunk_bits - s) * n + s * (n - covered)
            if best is None or cost < best[0]:
                best = (cost, mask, patterns)
        assert best is not None
        _, mask, patterns = best
        codebook = patterns[:k] or [0]  # (an empty sample has no pattern)
        codebook += codebook[:1] * (k - len(codebook))
        masks.append(mask)
        codebooks += codebook
    return np.array(masks, dtype=np.uint64), np.array(codebooks, dtype=np.uint64)


# -- rows ----------------------------------------------------------------------------------------
def encode_row(
    row: bytes,
    mask: np.ndarray,
    bitval: np.ndarray,
    chunk_bits: int,
    code_bits: int | None = None,
) -> bytes:
    """The compressed encoding of one row: codes, free fields, exceptions (format.h).

    ``bitval`` is the flat codebook of V * K entries; ``code_bits`` defaults to the width its
    length implies (C = 1: one pattern per position).
    """
    c = _resolve_code_bits(mask, bitval, code_bits)
    k = codebook_size(c)
    chunks = chunks_of(row, chunk_bits)
    full = (1 << chunk_bits) - 1
    v = len(chunks)
    stream, field = 0, v * c
    exceptions: list[tuple[int, int]] = []  # (value, width) of escaped chunks
    for j, x in enumerate(chunks):
        m = int(mask[j])
        stream |= extract(x, ~m & full) << field
        field += bin(~m & full).count("1")
        code = chunk_code(x, m, [int(p) for p in bitval[j * k : (j + 1) * k]])
        stream |= code << (j * c)
        if code == 0:
            exceptions.append((extract(x, m), bin(m).count("1")))
    pos = field
    for value, width in exceptions:
        stream |= value << pos
        pos += width
    return stream.to_bytes(-(-pos // 8), "little")


def decode_row(
    enc: bytes,
    mask: np.ndarray,
    bitval: np.ndarray,
    chunk_bits: int,
    row_bytes: int,
    code_bits: int | None = None,
) -> bytes:
    c = _resolve_code_bits(mask, bitval, code_bits)
    k = codebook_size(c)
    v = num_chunks(row_bytes, chunk_bits)
    full = (1 << chunk_bits) - 1
    stream = int.from_bytes(enc, "little")
    field = v * c
    exception = field + sum(bin(~int(m) & full).count("1") for m in mask)
    out = []
    for j in range(v):
        m = int(mask[j])
        free = bin(~m & full).count("1")
        code = (stream >> (j * c)) & ((1 << c) - 1)
        pattern = int(bitval[j * k + code - 1]) if code else 0
        x = pattern | deposit((stream >> field) & ((1 << free) - 1), ~m & full)
        field += free
        if code == 0:
            width = chunk_bits - free
            x = (x & ~m) | deposit((stream >> exception) & ((1 << width) - 1), m)
            exception += width
        out.append(x)
    s = chunk_bits // 8
    return b"".join(x.to_bytes(s, "little") for x in out)[:row_bytes]


# -- tables --------------------------------------------------------------------------------------
def compress(
    rows: np.ndarray,
    chunk_bits: int,
    mask: np.ndarray,
    bitval: np.ndarray,
    align: int = 8,
    code_bits: int | None = None,
) -> RefTable:
    """The whole table; ``code_bits`` defaults to the width the codebook length implies."""
    n, row_bytes = rows.shape
    code_bits = _resolve_code_bits(mask, bitval, code_bits)
    unit = slot_unit_bytes(row_bytes, align)
    raw_units = -(-row_bytes // unit)
    blocks = num_blocks(n)
    payload = bytearray()
    block_base = np.zeros(blocks + 1, dtype=np.int64)
    row_units = np.zeros(blocks * ROWS_PER_BLOCK, dtype=np.uint8)
    bitmask = np.zeros(-(-n // 32), dtype=np.uint32)
    for r in range(n):
        if r % ROWS_PER_BLOCK == 0:
            block_base[r // ROWS_PER_BLOCK] = len(payload)
        row = bytes(rows[r])
        enc = encode_row(row, mask, bitval, chunk_bits, code_bits)
        units = -(-len(enc) // unit)
        if units < raw_units:
            bitmask[r // 32] |= np.uint32(1 << (r % 32))
        else:
            enc, units = row, raw_units
        row_units[r] = units
        payload += enc + bytes(units * unit - len(enc))
    block_base[blocks] = len(payload)
    payload += bytes(PAYLOAD_PAD)
    return RefTable(
        np.frombuffer(bytes(payload), dtype=np.uint8),
        block_base,
        row_units,
        bitmask,
        mask,
        bitval,
        chunk_bits,
        row_bytes,
        unit,
        n,
        code_bits,
    )


def row_offset(t: RefTable, r: int) -> int:
    b = r // ROWS_PER_BLOCK
    before = t.row_units[b * ROWS_PER_BLOCK : r].astype(np.int64).sum()
    return int(t.block_base[b] + t.unit_bytes * before)


def gather(t: RefTable, ids: np.ndarray) -> np.ndarray:
    out = np.zeros((len(ids), t.row_bytes), dtype=np.uint8)
    for i, r in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
        if not 0 <= r < t.num_rows:
            raise IndexError(f"index {r} is out of range for a table of {t.num_rows} rows")
        start = row_offset(t, r)
        slot = bytes(t.payload[start : start + int(t.row_units[r]) * t.unit_bytes])
        if (int(t.bitmask[r // 32]) >> (r % 32)) & 1:
            row = decode_row(slot, t.mask, t.bitval, t.chunk_bits, t.row_bytes, t.code_bits)
        else:
            row = slot[: t.row_bytes]
        out[i] = np.frombuffer(row, dtype=np.uint8)
    return out


def decompress(t: RefTable) -> np.ndarray:
    return gather(t, np.arange(t.num_rows))


# -- pooled lookup -------------------------------------------------------------------------------
def row_values(rows: np.ndarray, kind: str) -> np.ndarray:
    """Rows of uint8 bytes widened to float64: kind is a numpy dtype name or 'int8_rowwise'."""
    if kind == "int8_rowwise":
        scale = rows[:, 0:2].copy().view(np.float16).astype(np.float64)
        bias = rows[:, 2:4].copy().view(np.float16).astype(np.float64)
        return rows[:, INT8_ROWWISE_HEADER_BYTES:].astype(np.float64) * scale + bias
    if kind == "bfloat16":
        widened = rows.copy().view(np.uint16).astype(np.uint32) << np.uint32(16)
        return widened.view(np.float32).astype(np.float64)
    return rows.copy().view(np.dtype(kind)).astype(np.float64)


def lookup_pooled(
    values: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    weights: np.ndarray | None,
    pooling: str,
) -> np.ndarray:
    """Exact (float64) pooled lookup over widened row values [N, D]."""
    bags = len(offsets) - 1
    out = np.zeros((bags, values.shape[1]), dtype=np.float64)
    for b in range(bags):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        w = np.ones(hi - lo) if weights is None else np.asarray(weights[lo:hi], dtype=np.float64)
        out[b] = (w[:, None] * values[ids[lo:hi]]).sum(axis=0)
        if pooling == "mean" and hi > lo:
            out[b] /= hi - lo
    return out


def pooled_tolerance(
    values: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    weights: np.ndarray | None,
    pooling: str,
) -> np.ndarray:
    """Per-element bound on |fp32 result - exact| for sequential fp32 accumulation.

    Each of the L products and L additions rounds once (relative error <= u = 2^-24), so
    |error| <= (L + 1) * u * sum_i |w_i * x_i| (+ one rounding for MEAN's scaling), the classic
    bound for recursive summation; doubled to cover two implementations summing in different
    orders against each other. Dequantised int8 values add one rounding per term (+2 u).
    """
    u = 2.0**-24
    bags = len(offsets) - 1
    tol = np.zeros((bags, values.shape[1]), dtype=np.float64)
    for b in range(bags):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        w = np.ones(hi - lo) if weights is None else np.asarray(weights[lo:hi], dtype=np.float64)
        magnitude = (np.abs(w[:, None] * values[ids[lo:hi]])).sum(axis=0)
        length = hi - lo
        bound = 2 * (length + 4) * u * magnitude
        if pooling == "mean" and length:
            bound /= length
        tol[b] = bound
    return tol
