# SPDX-License-Identifier: Apache-2.0
"""Pure numpy/Python reference of the codec and the lookups: the test oracle.

Written for clarity, not speed (Python integers as bit streams, one row at a time), and
independent of the C++ code: it re-derives the layout from format.h's prose. The C++ codec must
produce byte-identical payloads, identical masks and identical rows; pooled lookups agree within
the tolerance that ``pooled_tolerance`` derives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROWS_PER_BLOCK = 32
MAX_UNITS_PER_ROW = 255
PAYLOAD_PAD = 16
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
    mask: np.ndarray  # uint64
    bitval: np.ndarray  # uint64
    chunk_bits: int
    row_bytes: int
    unit_bytes: int
    num_rows: int


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


# -- rows ----------------------------------------------------------------------------------------
def encode_row(row: bytes, mask: np.ndarray, bitval: np.ndarray, chunk_bits: int) -> bytes:
    """The compressed encoding of one row: participation bits, free fields, exceptions."""
    chunks = chunks_of(row, chunk_bits)
    full = (1 << chunk_bits) - 1
    v = len(chunks)
    stream, field = 0, v
    exceptions: list[tuple[int, int]] = []  # (value, width) of non-participating chunks
    for j, x in enumerate(chunks):
        m, b = int(mask[j]), int(bitval[j])
        stream |= extract(x, ~m & full) << field
        field += bin(~m & full).count("1")
        if x & m == b:
            stream |= 1 << j
        else:
            exceptions.append((extract(x, m), bin(m).count("1")))
    pos = field
    for value, width in exceptions:
        stream |= value << pos
        pos += width
    return stream.to_bytes(-(-pos // 8), "little")


def decode_row(
    enc: bytes, mask: np.ndarray, bitval: np.ndarray, chunk_bits: int, row_bytes: int
) -> bytes:
    v = num_chunks(row_bytes, chunk_bits)
    full = (1 << chunk_bits) - 1
    stream = int.from_bytes(enc, "little")
    field = v
    exception = v + sum(bin(~int(m) & full).count("1") for m in mask)
    out = []
    for j in range(v):
        m, b = int(mask[j]), int(bitval[j])
        k = bin(~m & full).count("1")
        x = b | deposit((stream >> field) & ((1 << k) - 1), ~m & full)
        field += k
        if not (stream >> j) & 1:
            width = chunk_bits - k
            x = (x & ~m) | deposit((stream >> exception) & ((1 << width) - 1), m)
            exception += width
        out.append(x)
    s = chunk_bits // 8
    return b"".join(x.to_bytes(s, "little") for x in out)[:row_bytes]


# -- tables --------------------------------------------------------------------------------------
def compress(
    rows: np.ndarray, chunk_bits: int, mask: np.ndarray, bitval: np.ndarray, align: int = 8
) -> RefTable:
    n, row_bytes = rows.shape
    unit = slot_unit_bytes(row_bytes, align)
    raw_units = -(-row_bytes // unit)
    blocks = -(-n // ROWS_PER_BLOCK)
    payload = bytearray()
    block_base = np.zeros(blocks + 1, dtype=np.int64)
    row_units = np.zeros(blocks * ROWS_PER_BLOCK, dtype=np.uint8)
    bitmask = np.zeros(-(-n // 32), dtype=np.uint32)
    for r in range(n):
        if r % ROWS_PER_BLOCK == 0:
            block_base[r // ROWS_PER_BLOCK] = len(payload)
        row = bytes(rows[r])
        enc = encode_row(row, mask, bitval, chunk_bits)
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
            row = decode_row(slot, t.mask, t.bitval, t.chunk_bits, t.row_bytes)
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
