# SPDX-License-Identifier: Apache-2.0
"""The C++ codec against the independent numpy reference: same masks, same bytes, same rows.

The reference's own properties come first for the codebook mode (C = code_bits > 1, format.h):
it round-trips, its sizes follow the format's formula, and its fit is the documented one. The
C++ comparisons for C > 1 follow.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C, codec
from ibpembed import reference as ref
from ibpembed._ops import ops
from ibpembed.codec import slot_unit_bytes
from tests.codec.tables import DIMS, DTYPES, make_table, same_bits

KINDS = ("random_bits", "edge_values", "trained_like", "near_invariant")
ALL_KINDS = (*KINDS, "identical_rows")
CHUNK_BITS = (16, 32, 64)
CODE_BITS = (2, 3, 4)


def assert_same_layout(arrays: tuple[torch.Tensor, ...], expected: ref.RefTable) -> None:
    """ibp_compress's (payload, block_base, row_units, bitmask) equal the reference's."""
    payload, block_base, row_units, bitmask = arrays
    np.testing.assert_array_equal(payload.numpy(), expected.payload)
    np.testing.assert_array_equal(block_base.numpy(), expected.block_base)
    np.testing.assert_array_equal(row_units.numpy(), expected.row_units)
    np.testing.assert_array_equal(bitmask.numpy().view(np.uint32), expected.bitmask)


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from((1, 3, 8, 33)),
    kind=st.sampled_from(KINDS),
    chunk_bits=st.sampled_from((16, 32, 64)),
    method=st.sampled_from(("ibpembed", "paper")),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpp_codec_matches_reference_byte_for_byte(
    dtype, rows, dim, kind, chunk_bits, method, align, seed
) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    u8 = table.view(torch.uint8).reshape(rows, -1)
    npy = u8.numpy()

    mask, bitval = ops.ibp_fit(u8, chunk_bits, method)
    ref_fit = ref.fit_greedy if method == "ibpembed" else ref.fit_paper
    ref_mask, ref_bitval = ref_fit(npy, chunk_bits)
    np.testing.assert_array_equal(mask.numpy().view(np.uint64), ref_mask)
    np.testing.assert_array_equal(bitval.numpy().view(np.uint64), ref_bitval)

    unit = slot_unit_bytes(u8.shape[1], align)
    assert unit == ref.slot_unit_bytes(u8.shape[1], align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(u8, chunk_bits, mask, bitval, unit)
    expected = ref.compress(npy, chunk_bits, ref_mask, ref_bitval, align)
    assert_same_layout((payload, block_base, row_units, bitmask), expected)

    np.testing.assert_array_equal(ref.decompress(expected), npy)
    slots = ops.ibp_slot_bytes(u8, chunk_bits, mask, bitval, unit)
    np.testing.assert_array_equal(slots.numpy(), expected.row_units[:rows].astype(np.int64) * unit)


def test_reference_bit_helpers_are_inverse() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        mask = int(rng.integers(0, 2**63)) | int(rng.integers(0, 2))
        x = int(rng.integers(0, 2**63))
        assert ref.deposit(ref.extract(x, mask), mask) == x & mask


# -- codebook mode (C > 1): the reference on its own ----------------------------------------------
def _chunk_matrix(npy: np.ndarray, chunk_bits: int) -> list[list[int]]:
    return [ref.chunks_of(bytes(r), chunk_bits) for r in npy]


def _rows_from_chunks(chunks: list[list[int]], chunk_bits: int, row_bytes: int) -> np.ndarray:
    s = chunk_bits // 8
    raw = b"".join(b"".join(x.to_bytes(s, "little") for x in row)[:row_bytes] for row in chunks)
    return np.frombuffer(raw, dtype=np.uint8).reshape(len(chunks), row_bytes).copy()


def random_codebook(
    rng: np.random.Generator, v: int, chunk_bits: int, code_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random masks (empty, full, sparse, dense) and codebooks inside them, duplicates allowed."""
    full = (1 << chunk_bits) - 1
    k = ref.codebook_size(code_bits)
    masks, book = [], []
    for _ in range(v):
        density = rng.choice([0.0, 1.0, rng.uniform(0, 1)], p=[0.1, 0.1, 0.8])
        m = sum(1 << t for t in range(chunk_bits) if rng.random() < density)
        entries = [int(rng.integers(0, full, endpoint=True, dtype=np.uint64)) & m for _ in range(k)]
        if rng.random() < 0.2:  # a repeated entry: only the first of equal patterns is ever used
            entries[int(rng.integers(k))] = entries[0]
        masks.append(m)
        book += entries
    return np.array(masks, dtype=np.uint64), np.array(book, dtype=np.uint64)


def steer_into_codebook(
    npy: np.ndarray,
    mask: np.ndarray,
    bitval: np.ndarray,
    chunk_bits: int,
    code_bits: int,
    rng: np.random.Generator,
    hit: float,
) -> np.ndarray:
    """Rows whose chunks take a codebook pattern with probability ``hit``, keeping their free
    bits (NaN payloads, signs and mantissas stay); the rest keep their bits and mostly escape."""
    k = ref.codebook_size(code_bits)
    chunks = _chunk_matrix(npy, chunk_bits)
    for row in chunks:
        for j, x in enumerate(row):
            if rng.random() < hit:
                m = int(mask[j])
                row[j] = (x & ~m) | int(bitval[j * k + int(rng.integers(k))])
    return _rows_from_chunks(chunks, chunk_bits, npy.shape[1])


def expected_codes(row: bytes, mask, bitval, chunk_bits: int, code_bits: int) -> list[int]:
    """Per chunk: the smallest k whose pattern matches the masked bits, 0 if none (format.h)."""
    k = ref.codebook_size(code_bits)
    codes = []
    for j, x in enumerate(ref.chunks_of(row, chunk_bits)):
        m = int(mask[j])
        hits = [i + 1 for i in range(k) if x & m == int(bitval[j * k + i])]
        codes.append(hits[0] if hits else 0)
    return codes


def steered_table(
    dtype: torch.dtype,
    rows: int,
    dim: int,
    kind: str,
    chunk_bits: int,
    code_bits: int,
    hit: float,
    seed: int,
) -> tuple[np.random.Generator, np.ndarray, np.ndarray, np.ndarray]:
    """(rng, uint8 rows, mask, bitval): a random codebook and rows steered into it."""
    rng = np.random.default_rng(seed)
    npy = make_table(dtype, rows, dim, kind, seed).view(torch.uint8).reshape(rows, -1).numpy()
    v = ref.num_chunks(npy.shape[1], chunk_bits)
    mask, bitval = random_codebook(rng, v, chunk_bits, code_bits)
    npy = steer_into_codebook(npy, mask, bitval, chunk_bits, code_bits, rng, hit)
    return rng, npy, mask, bitval


def check_encoding(row: bytes, mask, bitval, chunk_bits: int, code_bits: int) -> None:
    """encode_row against format.h's layout: size, codes, free fields, exceptions, round trip."""
    full = (1 << chunk_bits) - 1
    enc = ref.encode_row(row, mask, bitval, chunk_bits, code_bits)
    chunks = ref.chunks_of(row, chunk_bits)
    v = len(chunks)
    codes = expected_codes(row, mask, bitval, chunk_bits, code_bits)
    free = [chunk_bits - bin(int(m)).count("1") for m in mask]
    escaped = sum(chunk_bits - f for f, c in zip(free, codes, strict=True) if c == 0)
    bits = v * code_bits + sum(free) + escaped
    assert len(enc) == -(-bits // 8)
    stream = int.from_bytes(enc, "little")
    assert stream >> bits == 0  # the last byte's spare bits are zero
    take = lambda pos, width: (stream >> pos) & ((1 << width) - 1)  # noqa: E731
    field = v * code_bits
    exception = field + sum(free)
    for j, x in enumerate(chunks):
        m = int(mask[j])
        assert take(j * code_bits, code_bits) == codes[j]
        assert take(field, free[j]) == ref.extract(x, ~m & full)
        field += free[j]
        if codes[j] == 0:
            assert take(exception, chunk_bits - free[j]) == ref.extract(x, m)
            exception += chunk_bits - free[j]
    assert exception == bits
    assert ref.decode_row(enc, mask, bitval, chunk_bits, len(row), code_bits) == row
    # The codebook's length implies C: the default reads it the same way.
    assert ref.encode_row(row, mask, bitval, chunk_bits) == enc


def check_table(npy: np.ndarray, chunk_bits, mask, bitval, align, code_bits, ids) -> ref.RefTable:
    t = ref.compress(npy, chunk_bits, mask, bitval, align, code_bits)
    assert t.code_bits == code_bits
    np.testing.assert_array_equal(ref.decompress(t), npy)
    np.testing.assert_array_equal(ref.gather(t, ids), npy[ids])
    raw_units = -(-npy.shape[1] // t.unit_bytes)
    for r in range(npy.shape[0]):
        enc = ref.encode_row(bytes(npy[r]), mask, bitval, chunk_bits, code_bits)
        comp_units = -(-len(enc) // t.unit_bytes)
        compressed = bool((int(t.bitmask[r // 32]) >> (r % 32)) & 1)
        assert compressed == (comp_units < raw_units)
        assert int(t.row_units[r]) == (comp_units if compressed else raw_units)
    return t


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from(DIMS[:7]),
    kind=st.sampled_from(ALL_KINDS),
    chunk_bits=st.sampled_from(CHUNK_BITS),
    code_bits=st.sampled_from(CODE_BITS),
    hit=st.sampled_from((0.0, 0.5, 0.9, 1.0)),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_reference_codebooks_round_trip_random_codebooks(
    dtype, rows, dim, kind, chunk_bits, code_bits, hit, align, seed
) -> None:
    rng, npy, mask, bitval = steered_table(dtype, rows, dim, kind, chunk_bits, code_bits, hit, seed)
    assert all(
        int(e) & ~int(mask[i // ref.codebook_size(code_bits)]) == 0 for i, e in enumerate(bitval)
    )
    for r in range(rows):
        check_encoding(bytes(npy[r]), mask, bitval, chunk_bits, code_bits)
    check_table(npy, chunk_bits, mask, bitval, align, code_bits, rng.integers(0, rows, 2 * rows))


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 60),
    dim=st.sampled_from(DIMS[:8]),
    kind=st.sampled_from(ALL_KINDS),
    chunk_bits=st.sampled_from(CHUNK_BITS),
    code_bits=st.sampled_from(CODE_BITS),
    align=st.sampled_from((1, 8)),
    seed=st.integers(0, 2**32 - 1),
)
def test_reference_codebooks_round_trip_fitted(
    dtype, rows, dim, kind, chunk_bits, code_bits, align, seed
) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    npy = table.view(torch.uint8).reshape(rows, -1).numpy()
    mask, bitval = ref.fit_codebooks(npy, chunk_bits, code_bits)
    check_fit_is_the_documented_one(npy, chunk_bits, code_bits, mask, bitval)
    for r in range(rows):
        check_encoding(bytes(npy[r]), mask, bitval, chunk_bits, code_bits)
    ids = np.random.default_rng(seed).integers(0, rows, 2 * rows)
    check_table(npy, chunk_bits, mask, bitval, align, code_bits, ids)
    # Rows the fit never saw still round-trip (mostly escapes).
    other = make_table(dtype, rows, dim, "random_bits", seed + 1)
    other_npy = other.view(torch.uint8).reshape(rows, -1).numpy()
    check_table(other_npy, chunk_bits, mask, bitval, align, code_bits, ids)


def _conditional_ranking(col: list[int], chunk_bits: int) -> list[int]:
    """Greedy: the next bit maximises the sum, over the groups of rows that agree on the bits
    ranked so far, of the bit's majority count; ties to the lower bit."""
    ranking: list[int] = []
    for _ in range(min(chunk_bits, 16)):
        groups = Counter()
        ones = Counter()
        for x in col:
            prefix = tuple((x >> t) & 1 for t in ranking)
            groups[prefix] += 1
            for t in range(chunk_bits):
                ones[prefix, t] += (x >> t) & 1
        scores = {
            t: sum(max(ones[p, t], size - ones[p, t]) for p, size in groups.items())
            for t in range(chunk_bits)
            if t not in ranking
        }
        ranking.append(max(scores, key=lambda t: (scores[t], -t)))
    return ranking


def check_fit_is_the_documented_one(npy, chunk_bits, code_bits, mask, bitval) -> None:
    """fit_codebooks re-derived another way (Counter, explicit sums): shapes, the invariant
    bitval & ~mask == 0, the mask a least-cost prefix of the conditional ranking, the codebook
    the K most frequent patterns (ties: smaller first), padded with the first."""
    k = ref.codebook_size(code_bits)
    rows = npy[: ref.CODEBOOK_FIT_ROWS]
    n = rows.shape[0]
    chunks = _chunk_matrix(rows, chunk_bits)
    v = ref.num_chunks(npy.shape[1], chunk_bits)
    assert mask.shape == (v,) and mask.dtype == np.uint64
    assert bitval.shape == (v * k,) and bitval.dtype == np.uint64
    for j in range(v):
        col = [row[j] for row in chunks]
        ranking = _conditional_ranking(col[: ref.CODEBOOK_RANK_ROWS], chunk_bits)

        def cost(m: int, col=col) -> int:
            counts = sorted(Counter(x & m for x in col).values(), reverse=True)
            s = bin(m).count("1")
            return (chunk_bits - s) * n + s * (n - sum(counts[:k]))

        prefixes = [sum(1 << t for t in ranking[:s]) for s in range(min(chunk_bits, 16) + 1)]
        costs = [cost(m) for m in prefixes]
        m = int(mask[j])
        assert m == prefixes[costs.index(min(costs))]
        counts = Counter(x & m for x in col)
        book = [p for p, _ in sorted(counts.items(), key=lambda pc: (-pc[1], pc[0]))][:k]
        book += [book[0]] * (k - len(book))
        assert [int(e) for e in bitval[j * k : (j + 1) * k]] == book
        assert all(e & ~m == 0 for e in book)


@pytest.mark.parametrize("chunk_bits", CHUNK_BITS)
@pytest.mark.parametrize("code_bits", CODE_BITS)
def test_fit_codebooks_few_values_per_position(chunk_bits: int, code_bits: int) -> None:
    """At most K values per position: with W = 16 the mask takes the whole chunk and every row is
    codes only; wider chunks keep at most 16 mask bits and still code every row."""
    k = ref.codebook_size(code_bits)
    rng = np.random.default_rng(chunk_bits * 10 + code_bits)
    v, rows = 5, 200
    pool = rng.integers(0, 1 << chunk_bits, (v, k), dtype=np.uint64, endpoint=False)
    picks = rng.integers(0, k, (rows, v))
    chunks = [[int(pool[j, picks[r, j]]) for j in range(v)] for r in range(rows)]
    npy = _rows_from_chunks(chunks, chunk_bits, v * chunk_bits // 8)
    mask, bitval = ref.fit_codebooks(npy, chunk_bits, code_bits)
    check_fit_is_the_documented_one(npy, chunk_bits, code_bits, mask, bitval)
    assert all(bin(int(m)).count("1") <= 16 for m in mask)
    if chunk_bits == 16:
        assert all(int(m) == 0xFFFF for m in mask)
    for r in range(rows):
        assert 0 not in expected_codes(bytes(npy[r]), mask, bitval, chunk_bits, code_bits)
    t = check_table(npy, chunk_bits, mask, bitval, 1, code_bits, np.arange(rows))
    if chunk_bits == 16:
        assert set(t.row_units[:rows].tolist()) == {-(-v * code_bits // 8)}


def test_fit_codebooks_pads_with_the_most_frequent_pattern() -> None:
    # One position (W = 16), two distinct values: 0x3C00 three times, 0x4000 twice.
    npy = _rows_from_chunks([[0x3C00]] * 3 + [[0x4000]] * 2, 16, 2)
    mask, bitval = ref.fit_codebooks(npy, 16, 3)
    assert mask.tolist() == [0xFFFF]
    assert bitval.tolist() == [0x3C00, 0x4000] + [0x3C00] * 5
    # Equal counts: the smaller pattern first.
    npy = _rows_from_chunks([[0x4000], [0x3C00]], 16, 2)
    assert ref.fit_codebooks(npy, 16, 2)[1].tolist() == [0x3C00, 0x4000, 0x3C00]


def test_fit_codebooks_reads_the_first_65536_rows() -> None:
    rng = np.random.default_rng(7)
    head = rng.choice(
        np.array([0x3F80, 0x4000, 0xBF80], dtype=np.uint16), (ref.CODEBOOK_FIT_ROWS, 2)
    )
    tail = rng.integers(0, 1 << 16, (5000, 2), dtype=np.uint16)
    npy = np.concatenate([head, tail]).view(np.uint8)
    got = ref.fit_codebooks(npy, 16, 2)
    want = ref.fit_codebooks(npy[: ref.CODEBOOK_FIT_ROWS], 16, 2)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[0].tolist() == [0xFFFF, 0xFFFF]


def test_reference_code_bits_one_is_the_published_layout() -> None:
    """C = 1: code 1 = the old participation bit; code_bits given or implied, same bytes."""
    rng = np.random.default_rng(3)
    npy = make_table(torch.float32, 30, 5, "trained_like", 3).view(torch.uint8).reshape(30, -1)
    npy = npy.numpy()
    mask, bitval = ref.fit_greedy(npy, 32)
    a = ref.compress(npy, 32, mask, bitval, 8)
    b = ref.compress(npy, 32, mask, bitval, 8, code_bits=1)
    assert a.code_bits == b.code_bits == 1
    np.testing.assert_array_equal(a.payload, b.payload)
    for r in rng.integers(0, 30, 10):
        check_encoding(bytes(npy[r]), mask, bitval, 32, 1)
    with pytest.raises(ValueError):
        ref.compress(npy, 32, mask, bitval, 8, code_bits=2)


# -- codebook mode (C > 1): the C++ codec against the reference ------------------------------------
# These need the format-3 extension: ops.ibp_fit(sample, chunk_bits, method, code_bits) and the
# other ops reading C from the codebook's length (V * (2^C - 1) entries, format.h code_bits_for).
def _as_u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint64)


def _as_i64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint64).view(np.int64).copy())


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from((1, 3, 8, 33)),
    kind=st.sampled_from(KINDS),
    chunk_bits=st.sampled_from(CHUNK_BITS),
    code_bits=st.sampled_from(CODE_BITS),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpp_codebook_codec_matches_reference_byte_for_byte(
    dtype, rows, dim, kind, chunk_bits, code_bits, align, seed
) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    u8 = table.view(torch.uint8).reshape(rows, -1)
    npy = u8.numpy()

    mask, bitval = ops.ibp_fit(u8, chunk_bits, "ibpembed", code_bits)
    ref_mask, ref_bitval = ref.fit_codebooks(npy, chunk_bits, code_bits)
    np.testing.assert_array_equal(_as_u64(mask), ref_mask)
    np.testing.assert_array_equal(_as_u64(bitval), ref_bitval)

    unit = slot_unit_bytes(u8.shape[1], align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(u8, chunk_bits, mask, bitval, unit)
    expected = ref.compress(npy, chunk_bits, ref_mask, ref_bitval, align, code_bits)
    assert_same_layout((payload, block_base, row_units, bitmask), expected)

    slots = ops.ibp_slot_bytes(u8, chunk_bits, mask, bitval, unit)
    np.testing.assert_array_equal(slots.numpy(), expected.row_units[:rows].astype(np.int64) * unit)
    args = (payload, block_base, row_units, bitmask, mask, bitval, chunk_bits, npy.shape[1], unit)
    assert torch.equal(ops.ibp_decompress(*args, rows), u8)


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from((1, 3, 8, 33)),
    kind=st.sampled_from(ALL_KINDS),
    chunk_bits=st.sampled_from(CHUNK_BITS),
    code_bits=st.sampled_from(CODE_BITS),
    hit=st.sampled_from((0.0, 0.5, 0.9, 1.0)),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpp_codec_random_codebooks_match_reference(
    dtype, rows, dim, kind, chunk_bits, code_bits, hit, align, seed
) -> None:
    rng, npy, ref_mask, ref_bitval = steered_table(
        dtype, rows, dim, kind, chunk_bits, code_bits, hit, seed
    )
    u8 = torch.from_numpy(npy)
    mask, bitval = _as_i64(ref_mask), _as_i64(ref_bitval)

    unit = slot_unit_bytes(npy.shape[1], align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(u8, chunk_bits, mask, bitval, unit)
    expected = ref.compress(npy, chunk_bits, ref_mask, ref_bitval, align, code_bits)
    assert_same_layout((payload, block_base, row_units, bitmask), expected)

    args = (payload, block_base, row_units, bitmask, mask, bitval, chunk_bits, npy.shape[1], unit)
    # Several rounds of the decode pipeline.
    ids = torch.from_numpy(rng.integers(0, rows, 256))
    before = _C.pattern_lookup()
    try:
        for lookup in ("gather", "tables"):  # the avx512 decoder's two pattern lookups
            _C.set_pattern_lookup(lookup)
            assert torch.equal(ops.ibp_decompress(*args, rows), u8), lookup
            assert torch.equal(ops.ibp_gather(*args, rows, ids), u8[ids]), lookup
    finally:
        _C.set_pattern_lookup(before)


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from((1, 3, 8, 33)),
    kind=st.sampled_from(KINDS),
    chunk_bits=st.sampled_from(CHUNK_BITS),
    code_bits=st.sampled_from(CODE_BITS),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_compress_code_bits_matches_reference(
    dtype, rows, dim, kind, chunk_bits, code_bits, align, seed
) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    npy = table.view(torch.uint8).reshape(rows, -1).numpy()
    c = codec.compress(table, code_bits=code_bits, chunk_bits=chunk_bits, align=align)
    assert c.code_bits == code_bits and c.chunk_bits == chunk_bits
    ref_mask, ref_bitval = ref.fit_codebooks(npy, chunk_bits, code_bits)
    np.testing.assert_array_equal(_as_u64(c.mask), ref_mask)
    np.testing.assert_array_equal(_as_u64(c.bitval), ref_bitval)
    expected = ref.compress(npy, chunk_bits, ref_mask, ref_bitval, align, code_bits)
    assert c.unit_bytes == expected.unit_bytes
    np.testing.assert_array_equal(c.payload.numpy(), expected.payload)
    np.testing.assert_array_equal(c.block_base.numpy(), expected.block_base)
    np.testing.assert_array_equal(c.row_units.numpy(), expected.row_units)
    np.testing.assert_array_equal(c.bitmask.numpy().view(np.uint32), expected.bitmask)
    assert same_bits(c.decompress(), table)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, rows, 2 * rows))
    assert same_bits(c.gather(ids), table[ids])


@pytest.mark.parametrize("chunk_bits", (16, 32, 64))
def test_fit_codebooks_op_equals_one_fit_per_width(chunk_bits: int) -> None:
    # compress() probes several code widths with one ibp_fit_codebooks call: it must give what
    # ibp_fit gives for each width alone.
    rows = make_table(torch.bfloat16, 3000, 24, "trained_like", chunk_bits)
    npy = rows.view(torch.uint8).reshape(3000, -1)
    out = ops.ibp_fit_codebooks(npy, chunk_bits, [4, 2, 3])
    for i, code_bits in enumerate((4, 2, 3)):
        mask, bitval = ops.ibp_fit(npy, chunk_bits, "ibpembed", code_bits)
        assert torch.equal(out[2 * i], mask) and torch.equal(out[2 * i + 1], bitval)


def test_the_torch_free_codec_limits_are_the_headers() -> None:
    # codec_options copies format.h's limits so that command-line parsers skip torch.
    from ibpembed import codec_options, layout

    assert codec_options.MAX_SLOT_UNIT == layout.MAX_SLOT_UNIT
