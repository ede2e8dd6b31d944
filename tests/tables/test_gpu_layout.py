# SPDX-License-Identifier: Apache-2.0
"""Layouts for a GPU's zero-copy reads (ibpembed.tables.gpu_layout): line-aware slot placement
keeps every row bit for bit and never touches more lines; a table whose compressed slots would
cost more 32-byte sectors than raw rows is stored raw; ``pack --for-gpu`` records which and why,
and ``inspect`` prints it. The placement op equals the Python loop it replaced byte for byte
(``reference_line_aware``). The kernels reading such a layout: tests/cuda/test_simt_kernels.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed import compress, layout
from ibpembed.cli import main as cli_main
from ibpembed.codec import CompressedTable
from ibpembed.tables import format as tf
from ibpembed.tables import gpu_layout
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from ibpembed.tables.writer import pack_table
from tests.codec.tables import DTYPES, make_table, same_bits


def reference_line_aware(t: CompressedTable) -> CompressedTable:
    """The placement as a plain loop over the rows (what ``gpu_layout.line_aware`` computed in
    Python before the ``ibp_line_aware`` op): the oracle the op must equal byte for byte."""
    sector, line = gpu_layout.SECTOR, gpu_layout.LINE
    unit = t.unit_bytes
    max_units = -(-t.row_bytes // unit)
    offsets, sizes = gpu_layout.slot_offsets(t)
    units = t.row_units.numpy().astype(np.int64)
    new_units = units.copy()
    new_offsets = np.empty(t.num_rows, dtype=np.int64)
    cursor = 0
    for r in range(t.num_rows):
        size = int(sizes[r])
        aligned = -(-cursor // sector) * sector
        gap = (aligned - cursor) // unit
        lines_there = (aligned % line + size + line - 1) // line
        lines_here = (cursor % line + size + line - 1) // line
        if (
            r > 0
            and gap
            and (aligned - cursor) % unit == 0
            and new_units[r - 1] + gap < max_units
            and lines_there < lines_here
        ):
            new_units[r - 1] += gap
            cursor = aligned
        new_offsets[r] = cursor
        cursor += size
    payload = np.zeros(cursor + layout.PAYLOAD_PAD, dtype=np.uint8)
    source = t.payload.numpy()
    for r in range(t.num_rows):
        payload[new_offsets[r] : new_offsets[r] + sizes[r]] = source[
            offsets[r] : offsets[r] + sizes[r]
        ]
    block_bytes = new_units.reshape(-1, layout.ROWS_PER_BLOCK).sum(axis=1) * unit
    block_base = np.concatenate([[0], np.cumsum(block_bytes)]).astype(np.int64)
    return dataclasses.replace(
        t,
        payload=torch.from_numpy(payload),
        block_base=torch.from_numpy(block_base),
        row_units=torch.from_numpy(new_units.astype(np.uint8)),
        hot=None,
    )


def assert_same_layout(got: CompressedTable, want: CompressedTable) -> None:
    assert got.payload.dtype == want.payload.dtype == torch.uint8
    assert torch.equal(got.payload, want.payload)
    assert got.block_base.dtype == want.block_base.dtype == torch.int64
    assert torch.equal(got.block_base, want.block_base)
    assert got.row_units.dtype == want.row_units.dtype == torch.uint8
    assert torch.equal(got.row_units, want.row_units)
    assert got.hot is None


def random_slots(base: CompressedTable, num_rows: int, seed: int) -> CompressedTable:
    """``base``'s shape (row bytes, slot unit) with ``num_rows`` slots of random sizes: every size
    from empty to a raw row's, short runs of one size, and random bytes in them."""
    rng = np.random.default_rng(seed)
    max_units = -(-base.row_bytes // base.unit_bytes)
    blocks = layout.num_blocks(num_rows)
    units = np.zeros(blocks * layout.ROWS_PER_BLOCK, dtype=np.int64)
    drawn = rng.integers(0, max_units + 1, num_rows)
    runs = rng.random(num_rows) < 0.2  # repeat the previous size now and then
    drawn[1:] = np.where(runs[1:], drawn[:-1], drawn[1:])
    units[:num_rows] = drawn
    block_bytes = units.reshape(-1, layout.ROWS_PER_BLOCK).sum(axis=1) * base.unit_bytes
    block_base = np.concatenate([[0], np.cumsum(block_bytes)]).astype(np.int64)
    payload = rng.integers(0, 256, int(block_base[-1]) + layout.PAYLOAD_PAD, dtype=np.uint8)
    return dataclasses.replace(
        base,
        num_rows=num_rows,
        payload=torch.from_numpy(payload),
        block_base=torch.from_numpy(block_base),
        row_units=torch.from_numpy(units.astype(np.uint8)),
        bitmask=torch.zeros(layout.bitmask_words(num_rows), dtype=torch.int32),
        hot=None,
    )


def trained(rows: int, dim: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return make_table(dtype, rows, dim, "trained_like", seed)


def all_rows(t) -> torch.Tensor:
    return t.gather(torch.arange(t.num_rows))


@pytest.mark.parametrize(
    ("dtype", "dim"), [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 200)]
)
def test_line_aware_placement_keeps_every_row_and_touches_no_more_lines(dtype, dim) -> None:
    c = compress(trained(3000, dim, dim, dtype))
    padded = gpu_layout.line_aware(c)
    assert same_bits(all_rows(padded), all_rows(c))
    before, after = gpu_layout.wire_cost(c), gpu_layout.wire_cost(padded)
    assert after.lines < before.lines  # these tables have slots to move
    _, sizes = gpu_layout.slot_offsets(c)
    new_offsets, _ = gpu_layout.slot_offsets(padded)
    moved = np.flatnonzero(new_offsets[1:] != new_offsets[:-1] + sizes[:-1]) + 1
    assert moved.size > 0
    line = gpu_layout.LINE
    for r in moved:
        assert new_offsets[r] % gpu_layout.SECTOR == 0
        natural = new_offsets[r - 1] + sizes[r - 1]
        size = int(sizes[r])
        assert (new_offsets[r] % line + size - 1) // line < (natural % line + size - 1) // line
    # The slot before each move took the gap and is still compressed (shorter than a raw slot).
    compressed = np.unpackbits(padded.bitmask.numpy().view(np.uint8), bitorder="little")
    assert compressed[moved - 1].all()
    max_units = -(-padded.row_bytes // padded.unit_bytes)
    assert (padded.row_units.numpy()[moved - 1] < max_units).all()


# (dtype, dim): 2- to 8400-byte rows, slot units of 1 to 64 bytes (wide rows: a unit above a
# sector, where no gap is a whole number of units and nothing moves).
SHAPES = [
    (torch.bfloat16, 1),
    (torch.uint8, 33),
    (torch.float16, 77),
    (torch.float32, 50),
    (torch.bfloat16, 129),
    (torch.float32, 128),
    (torch.float32, 257),
    (torch.float32, 2100),
]


@pytest.mark.parametrize(("dtype", "dim"), SHAPES)
@pytest.mark.parametrize("num_rows", [0, 1, 31, 33, 1001])
def test_line_aware_equals_the_reference_on_slots_of_every_size(dtype, dim, num_rows) -> None:
    base = compress(make_table(dtype, 64, dim, "trained_like", seed=dim))
    t = random_slots(base, num_rows, seed=num_rows * 1000 + dim)
    want = reference_line_aware(t)
    assert_same_layout(gpu_layout.line_aware(t), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [3, 64, 129])
@pytest.mark.parametrize("kind", ["trained_like", "near_invariant", "random_bits"])
def test_line_aware_equals_the_reference_on_compressed_tables(dtype, dim, kind) -> None:
    c = compress(make_table(dtype, 1037, dim, kind, seed=dim))
    got = gpu_layout.line_aware(c)
    assert_same_layout(got, reference_line_aware(c))
    assert same_bits(all_rows(got), all_rows(c))


def test_line_aware_equals_the_reference_on_an_int8_rowwise_table() -> None:
    rng = np.random.default_rng(8)
    codes = rng.integers(0, 256, (999, 132), dtype=np.uint8)  # 4-byte scale/bias, 128 codes
    codes[:, 0:4] = np.frombuffer(np.array([0.01, -0.5], dtype=np.float16).tobytes(), np.uint8)
    codes[:, 4:] &= 0x3F  # trained codes leave high bits alone: something to compress
    table = torch.from_numpy(codes)
    c = compress(table, quant="int8_rowwise")
    got = gpu_layout.line_aware(c)
    assert_same_layout(got, reference_line_aware(c))
    assert same_bits(all_rows(got), table)


def dlrm_profile(rows: int, dim: int, seed: int) -> torch.Tensor:
    """fp32 rows with a trained DLRM table's value profile (benchmarks.data.dlrm_table's
    recipe): per-row log-normal scales, a third of rows still at their uniform init, zero rows,
    a few diverged rows."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(rows, 1, generator=gen) * 0.7 + np.log(0.03))
    table = torch.randn(rows, dim, generator=gen) * scale + torch.randn(dim, generator=gen) * 0.005
    cold = torch.rand(rows, generator=gen) < 0.3
    table[cold] = torch.rand(int(cold.sum()), dim, generator=gen) * 0.02 - 0.01
    table[torch.randperm(rows, generator=gen)[: rows // 100]] = 0.0
    table[torch.randint(0, rows, (4,), generator=gen)] *= 1e3
    return table


def test_line_aware_equals_the_reference_on_a_packed_dlrm_table(tmp_path: Path) -> None:
    weight = dlrm_profile(5003, 128, seed=11)
    pack_table(tmp_path / "t.ibpt", weight, name="t")
    packed = tf.read_table(tmp_path / "t.ibpt").table  # the payload is the file's mapping
    got = gpu_layout.line_aware(packed)
    assert_same_layout(got, reference_line_aware(packed))
    assert gpu_layout.wire_cost(got).lines < gpu_layout.wire_cost(packed).lines
    assert same_bits(all_rows(got).view(torch.float32), weight)


def test_pack_for_gpu_decides_and_says_what_the_reference_placement_would(monkeypatch) -> None:
    """What ``inspect`` prints (the ``gpu_layout`` meta) is unchanged by the op."""
    for dim in (16, 50, 128):
        weight = dlrm_profile(3000, dim, seed=dim)
        c = compress(weight)
        table, decision = gpu_layout.for_gpu(c, lambda w=weight: compress(w, method="raw"))
        with monkeypatch.context() as m:
            m.setattr(gpu_layout, "line_aware", reference_line_aware)
            want_table, want = gpu_layout.for_gpu(c, lambda w=weight: compress(w, method="raw"))
        assert decision == want
        assert torch.equal(table.payload, want_table.payload)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_base": torch.zeros(5, dtype=torch.int64)}, "block_base must have"),
        ({"row_units": torch.zeros(31, dtype=torch.uint8)}, "row_units must have"),
        ({"payload": torch.zeros(8, dtype=torch.uint8)}, "outside the payload"),
        ({"unit_bytes": 3}, "not a valid slot unit"),
        ({"payload": torch.zeros(8, dtype=torch.int32)}, "payload must be"),
    ],
)
def test_line_aware_rejects_an_inconsistent_table(change, message) -> None:
    c = dataclasses.replace(compress(trained(40, 32, 9)), **change)
    with pytest.raises(ValueError, match=message):
        gpu_layout.line_aware(c)


def test_line_aware_rejects_a_base_whose_slot_end_wraps_past_2_63() -> None:
    # 33 rows: the last block holds one row, so no later row of its block would catch a slot
    # end that wrapped to a negative number; the copy would read far outside the payload.
    c = compress(trained(33, 32, 9))
    near_2_63 = torch.tensor([0, 2**63 - 8, 2**63 - 8])
    with pytest.raises(ValueError, match="row 32's slot lies outside the payload"):
        gpu_layout.line_aware(dataclasses.replace(c, block_base=near_2_63))


def test_the_file_format_accepts_a_line_aware_layout(tmp_path: Path) -> None:
    from ibpembed.tables import writer

    c = compress(make_table(torch.float32, 500, 128, "trained_like", seed=3))
    path = tmp_path / "t.ibpt"
    writer.write_table(path, gpu_layout.line_aware(c), name="t")
    loaded = tf.verify_file(path)  # index checks and the decoded rows' hash
    assert same_bits(all_rows(loaded.table), all_rows(c))


def test_narrow_fp32_rows_are_stored_raw_and_wide_ones_line_aware() -> None:
    narrow = trained(4000, 16, 1)  # 64-byte rows
    table, decision = gpu_layout.for_gpu(compress(narrow), lambda: compress(narrow, method="raw"))
    assert decision["layout"] == "raw" and decision["sector_ratio"] < 1
    assert "stored raw" in decision["reason"] and int(table.bitmask.sum()) == 0
    assert same_bits(all_rows(table), narrow)
    wide = trained(4000, 128, 2)  # 512-byte rows
    table, decision = gpu_layout.for_gpu(compress(wide), lambda: compress(wide, method="raw"))
    assert decision["layout"] == "line-aware" and decision["sector_ratio"] >= 1
    assert decision["line_ratio"] > decision["compact_line_ratio"]
    assert same_bits(all_rows(table), wide)


def test_raw_rows_cost_what_raw_rows_cost() -> None:
    t = trained(1000, 32, 4)
    cost = gpu_layout.wire_cost(compress(t, method="raw"))
    assert cost.sector_ratio == 1.0 and cost.line_ratio == 1.0


def test_pack_for_gpu_records_the_layout_and_inspect_says_why(tmp_path: Path, capsys) -> None:
    user = trained(3000, 128, 5)
    item = trained(2000, 16, 6)
    sources = (TableSource("user", user), TableSource("item", item))
    pack_table_set(tmp_path, TableSet(sources), sample_rows=None, for_gpu=True)
    store = TableStore.load(tmp_path, verify=True)
    with store.acquire() as snap:
        assert same_bits(snap.tables["user"].gather(torch.arange(3000)), user)
        assert same_bits(snap.tables["item"].gather(torch.arange(2000)), item)
    assert cli_main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gpu layout: line-aware: slots moved to 32-byte boundaries" in out
    assert "gpu layout: stored raw: its best compressed layout" in out


def test_pack_for_gpu_stores_a_table_raw_under_a_forced_code_width(tmp_path: Path, capsys) -> None:
    """--code-bits shapes the compressed layout; a table that goes raw has no codebooks, so the
    raw alternative is built without it instead of failing the pack."""
    item = trained(2000, 16, 6)  # stored raw (test above)
    np.save(tmp_path / "item.npy", item.numpy())
    out = tmp_path / "out"
    argv = ["pack", str(tmp_path / "item.npy"), "-o", str(out), "--no-progress", "--for-gpu"]
    assert cli_main([*argv, "--code-bits", "3", "--chunk-bits", "32"]) == 0
    assert cli_main(["inspect", str(out)]) == 0
    assert "gpu layout: stored raw" in capsys.readouterr().out
    assert cli_main(["verify", str(out)]) == 0


def test_pack_for_gpu_reports_every_row_to_the_progress_callback(tmp_path: Path) -> None:
    """A progress bar of ``pack --for-gpu`` reaches its total (and closes) like any pack's."""
    weight = trained(1000, 32, 7)
    done: list[int] = []
    packed = pack_table(tmp_path / "t.ibpt", weight, name="t", for_gpu=True, progress=done.append)
    assert sum(done) == 1000
    assert packed.num_rows == 1000 and packed.raw_bytes == weight.numel() * 4
