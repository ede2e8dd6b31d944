# SPDX-License-Identifier: Apache-2.0
"""Layouts for a GPU's zero-copy reads (ibpembed.tables.gpu_layout): line-aware slot placement
keeps every row bit for bit and never touches more lines; a table whose compressed slots would
cost more 32-byte sectors than raw rows is stored raw; ``pack --for-gpu`` records which and why,
and ``inspect`` prints it. The kernels reading such a layout: tests/cuda/test_simt_kernels.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed import compress
from ibpembed.cli import main as cli_main
from ibpembed.tables import format as tf
from ibpembed.tables import gpu_layout
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from ibpembed.tables.writer import pack_table
from tests.codec.tables import make_table, same_bits


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


def test_pack_for_gpu_reports_every_row_to_the_progress_callback(tmp_path: Path) -> None:
    """A progress bar of ``pack --for-gpu`` reaches its total (and closes) like any pack's."""
    weight = trained(1000, 32, 7)
    done: list[int] = []
    packed = pack_table(tmp_path / "t.ibpt", weight, name="t", for_gpu=True, progress=done.append)
    assert sum(done) == 1000
    assert packed.num_rows == 1000 and packed.raw_bytes == weight.numel() * 4
