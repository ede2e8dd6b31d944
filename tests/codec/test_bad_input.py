# SPDX-License-Identifier: Apache-2.0
"""Bad input gets a clear Python exception: never a crash, a clamp or a silent zero."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from ibpembed import _C, compress
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable, available_cpu_paths
from tests.codec.tables import staged_reads


@pytest.fixture(scope="module")
def table():
    return compress(torch.randn(100, 16))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.randn(10, 4).double(), TypeError, "unsupported table dtype"),
        (torch.randn(10, 4).long(), TypeError, "unsupported table dtype"),
        (torch.randn(10), ValueError, "2-D"),
        (torch.randn(2, 3, 4), ValueError, "2-D"),
        (torch.randn(8, 10)[:, ::2], ValueError, "contiguous"),
        (torch.randn(0, 4), ValueError, "non-empty"),
        (torch.randn(4, 0), ValueError, "non-empty"),
        ([[1.0, 2.0]], TypeError, "torch.Tensor"),
    ],
)
def test_compress_rejects_bad_tables(bad, error, match) -> None:
    with pytest.raises(error, match=match):
        compress(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "zstd"}, "method"),
        ({"chunk_bits": 8}, "chunk_bits"),
        ({"align": 12}, "power of two"),
        ({"align": 1 << 17}, "power of two <= 65536"),
        ({"sample_rows": 0}, "sample_rows"),
        ({"quant": "int4"}, "quant"),
    ],
)
def test_compress_rejects_bad_options(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        compress(torch.randn(50, 4), **kwargs)


def test_quant_needs_uint8_rows() -> None:
    with pytest.raises(ValueError, match="uint8"):
        compress(torch.randn(10, 8), quant="int8_rowwise")


@pytest.mark.parametrize("bad_id", [100, 10**12, 2**63 - 1, -1, -(2**63)])
def test_out_of_range_ids_name_the_id_and_the_table_size(table, bad_id: int) -> None:
    ids = torch.tensor([0, 5, bad_id])
    with pytest.raises(IndexError, match=rf"index {bad_id} at position 2 .* 100 rows"):
        table.gather(ids)
    with pytest.raises(IndexError, match=rf"index {bad_id}"):
        table.lookup(ids, torch.tensor([0, 3]))


@pytest.mark.parametrize("position", range(9))
def test_an_out_of_range_id_is_caught_at_any_position(table, position: int) -> None:
    # The range check runs two ids per vector step plus a scalar tail: every slot of both.
    ids = torch.full((9,), 99)
    assert torch.equal(table.gather(ids), table.gather(torch.tensor([99])).expand(9, -1))
    ids[position] = 100
    with pytest.raises(IndexError, match=rf"index 100 at position {position} "):
        table.gather(ids)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 3], r"offsets\[0\] must be 0"),
        ([0, 2], r"offsets\[-1\] must equal the number of indices \(3\)"),
        ([0, 4], r"offsets\[-1\]"),
        ([0, 2, 1, 3], "non-decreasing"),
        ([], "B \\+ 1"),
    ],
)
def test_bad_offsets(table, offsets, match) -> None:
    with pytest.raises(ValueError, match=match):
        table.lookup(torch.tensor([1, 2, 3]), torch.tensor(offsets, dtype=torch.int64))


def test_bad_lookup_arguments(table) -> None:
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="pooling"):
        table.lookup(ids, torch.tensor([0, 3]), pooling="max")
    with pytest.raises(TypeError, match="integer"):
        table.lookup(ids.float(), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="exactly one"):
        table.lookup(ids)
    with pytest.raises(ValueError, match="non-negative"):
        table.lookup(ids, lengths=torch.tensor([4, -1]))
    with pytest.raises(ValueError, match="one weight per index"):
        table.lookup(ids, torch.tensor([0, 3]), torch.ones(2))
    with pytest.raises(TypeError, match="float32"):
        table.lookup(ids, torch.tensor([0, 3]), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        table.gather(ids.view(3, 1))


def test_table_shape_problem_names_the_argument_the_op_rejects(table) -> None:
    """_C.table_shape_problem runs the ops' shape checks without raising: the argument at fault
    and the message the op raises, or None."""
    args = table.op_args()
    shapes = {k: v for k, v in args._asdict().items() if k != "payload"}
    assert _C.table_shape_problem(**shapes) is None
    arg, problem = _C.table_shape_problem(**{**shapes, "row_units": args.row_units[:-1]})
    assert arg == "row_units" and problem.startswith("row_units must have")
    with pytest.raises(ValueError, match=re.escape(problem)):
        ops.ibp_decompress(*args._replace(row_units=args.row_units[:-1]))
    for name, value in [("chunk_bits", 8), ("unit_bytes", 3), ("num_rows", -1), ("row_bytes", 0)]:
        arg, problem = _C.table_shape_problem(**{**shapes, name: value})
        assert arg == name and problem.startswith(name), problem
    arg, _ = _C.table_shape_problem(**{**shapes, "bitval": args.bitval[:-1]})
    assert arg == "bitval"


def test_plain_int8_rows_cannot_be_pooled() -> None:
    c = compress(torch.randint(0, 255, (10, 8), dtype=torch.uint8))
    with pytest.raises(TypeError, match="int8_rowwise"):
        c.lookup(torch.tensor([1]), torch.tensor([0, 1]))


def test_ops_validate_raw_tensor_arguments(table) -> None:
    args = table.op_args()
    with pytest.raises(ValueError, match="payload holds 10 bytes"):
        ops.ibp_decompress(*args._replace(payload=table.payload[:10]))
    with pytest.raises(ValueError, match="unit_bytes 3"):
        ops.ibp_decompress(*args._replace(unit_bytes=3))
    # Once sent the unit search into an endless loop.
    with pytest.raises(ValueError, match="not a valid slot unit"):
        ops.ibp_decompress(*args._replace(unit_bytes=(1 << 62) + 1))
    rows = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="minimum slot unit"):
        ops.ibp_slot_bytes(rows, 32, torch.zeros(4, dtype=torch.int64),
                           torch.zeros(4, dtype=torch.int64), (1 << 62) + 1)  # fmt: skip
    bad_mask = torch.full_like(table.mask, -1) if table.chunk_bits < 64 else table.mask[:1]
    with pytest.raises(ValueError, match="mask"):
        ops.ibp_decompress(*args._replace(mask=bad_mask))
    with pytest.raises(ValueError, match="bitval"):
        ops.ibp_decompress(*args._replace(bitval=table.bitval | ~table.mask))
    with pytest.raises(ValueError, match="chunk_bits"):
        ops.ibp_fit(torch.zeros(4, 4, dtype=torch.uint8), 8, "ibpembed")
    with pytest.raises(ValueError, match=r"uint8|Byte"):
        ops.ibp_fit(torch.zeros(4, 4), 32, "ibpembed")


# -- tables whose bytes contradict their layout ------------------------------------------------
# The ops trust a table's tensors past their shapes (checking every slot per call would cost a
# pass over the index), but the decoders bound every read: contradicting bytes, from a corrupted
# file whose payload was not verified at load, or from tensors built by hand, give a ValueError
# naming the row. Each case reads or writes past a buffer without those bounds (cases from
# review, confirmed under AddressSanitizer).


def _compressed_table(code_bits: int, row: int = 31) -> tuple[CompressedTable, int]:
    """A table of wide fp16 rows (many chunks: a slot of all-escape codes claims far more bits
    than it holds) and a row stored compressed: by default near the end of a block, in the middle
    of the payload (decoded in place, or from a stage where the table's reads are staged and its
    predecessor is not read just before it); row 63 is the payload's last (always decoded from a
    stage)."""
    weight = (torch.randn(64, 2048) * 0.02).to(torch.float16)
    table = compress(weight, chunk_bits=16, code_bits=code_bits)
    assert bool(table.is_compressed(torch.tensor([row])))
    return table, row


@pytest.mark.parametrize("path", available_cpu_paths())
@pytest.mark.parametrize("code_bits", [1, 4])
@pytest.mark.parametrize("where", [31, 63])
@pytest.mark.parametrize("after_its_predecessor", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_a_zeroed_slot_is_refused_not_read_past(
    restore_path, path: str, code_bits: int, where: int, after_its_predecessor: bool, staged: bool
) -> None:
    table, row = _compressed_table(code_bits, where)
    _C.set_cpu_path(path)
    payload = table.payload.clone()
    start = int(table.block_base[row // 32]) + table.unit_bytes * int(
        table.row_units[row // 32 * 32 : row].sum()
    )
    payload[start : start + table.unit_bytes * int(table.row_units[row])] = 0
    corrupted = dataclasses.replace(table, payload=payload)
    ids = torch.tensor([row - 1 if after_its_predecessor else 0, row, 5])
    # All-zero codes escape every chunk: the exceptions they claim run far past the slot.
    match = rf"corrupted table: row {row}: its codes ask for more bits"
    with staged_reads(staged):
        with pytest.raises(ValueError, match=match):
            corrupted.gather(ids)
        with pytest.raises(ValueError, match=match):
            corrupted.lookup(ids, torch.tensor([0, 3]))


@pytest.mark.parametrize("path", available_cpu_paths())
def test_a_raw_bit_on_a_short_slot_changes_nothing_on_cpu(restore_path, path: str) -> None:
    # The CPU decoders take a row's compressed bit from its slot size (format.h), so a bitmask
    # that contradicts the slots can neither send a raw copy past a short slot nor change a row.
    table, row = _compressed_table(1)
    _C.set_cpu_path(path)
    lying = dataclasses.replace(table, bitmask=torch.zeros_like(table.bitmask))
    ids = torch.tensor([row, 0, row])
    assert torch.equal(lying.gather(ids).view(torch.uint8), table.gather(ids).view(torch.uint8))
    offsets = torch.tensor([0, 1, 3])
    assert torch.equal(lying.lookup(ids, offsets), table.lookup(ids, offsets))


@pytest.mark.parametrize("path", available_cpu_paths())
@pytest.mark.parametrize("units", [255, 0])
def test_a_slot_size_the_layout_rules_out_is_refused(restore_path, path: str, units: int) -> None:
    table, row = _compressed_table(4)
    _C.set_cpu_path(path)
    row_units = table.row_units.clone()
    row_units[row] = units  # 255: larger than a raw slot; 0: no bytes at all
    with pytest.raises(ValueError, match=rf"corrupted table: row {row}"):
        dataclasses.replace(table, row_units=row_units).gather(torch.tensor([row]))


def test_a_slot_past_the_payload_is_refused(table) -> None:
    bases = table.block_base.clone()
    bases[1:-1] = int(bases[-1])  # blocks after the first start at the payload's end
    with pytest.raises(ValueError, match="corrupted table: row 40"):
        dataclasses.replace(table, block_base=bases).gather(torch.tensor([3, 40]))


# -- index and tier fields whose sums could wrap ------------------------------------------------
# Each of these once passed a bound check whose sum wrapped and crashed the process (SIGSEGV), so
# each runs in a child process: a regression fails the test instead of killing pytest.

_HOSTILE = textwrap.dedent(
    """
    import dataclasses, sys
    import torch
    from ibpembed import _C, codec
    from ibpembed._ops import ops

    def table_args(t, **fields):
        return dataclasses.replace(t, **fields).op_args()

    def report(call):
        try:
            call()
        except Exception as e:
            print(type(e).__name__, str(e).splitlines()[0])
        else:
            print("no error")

    case = sys.argv[1]
    torch.manual_seed(0)
    if case == "slot_base":  # offset + slot bytes wraps: a block base the bound let through
        for path in codec.available_cpu_paths():
            _C.set_cpu_path(path)
            for rows in (torch.randint(0, 256, (64, 200), dtype=torch.uint8),
                         (torch.randn(64, 256) * 0.01).to(torch.bfloat16)):
                t = codec.compress(rows, align=1)
                base = t.block_base.clone()
                base[1] = (1 << 63) - 1 - 50
                report(lambda: ops.ibp_gather(*table_args(t, block_base=base),
                                              torch.tensor([32]), None, None))
    elif case == "slot_base_set":  # the same through TableSet::add and its pooled lookup
        t = codec.compress(torch.randn(64, 50), method="raw", align=1)
        base = t.block_base.clone()
        base[1] = (1 << 63) - 1 - 50
        s = codec.CompressedTableSet([dataclasses.replace(t, block_base=base)])
        report(lambda: s.lookup(torch.tensor([[0, 0, 1]]), torch.tensor([32]),
                                torch.tensor([0, 1])))
    elif case in ("payload_end", "payload_end_set"):  # end + pad wraps: no slot bound holds
        t = codec.compress(torch.randn(64, 16), method="raw")
        base = t.block_base.clone()
        base[-1] = (1 << 63) - 1 - 5
        base[1] = 10**12
        bad = dataclasses.replace(t, block_base=base)
        ids = torch.tensor([40])
        if case == "payload_end":
            report(lambda: ops.ibp_gather(*bad.op_args(), ids, None, None))
        else:
            report(lambda: codec.CompressedTableSet([bad]).lookup(
                torch.tensor([[0, 0, 1]]), ids, torch.tensor([0, 1])))
    else:  # a tier directory word's base past the tier: "tier_gather 1099511627776", ...
        what, word_base = case.split()
        rows = (torch.randn(256, 32) * 0.01).to(torch.bfloat16)
        t = codec.compress(rows, code_bits=1).with_hot_rows(torch.arange(0, 256, 3))
        directory = t.hot.directory.clone()
        directory[1] = int(word_base)  # word 0's base: the tier rows before it, 0
        tier = (directory, t.hot.rows)
        # Row 3 is word 0's second tier row: a base of -1 (2^64 - 1) wraps its slot to 0.
        ids = torch.tensor([3])
        if what == "tier_gather":
            report(lambda: ops.ibp_gather(*t.op_args(), ids, *tier))
        else:
            report(lambda: ops.lookup_pooled(*t.op_args(), ids, torch.tensor([0, 1]), None, 2, 0,
                                             *tier))
    """
)


def _hostile(case: str) -> list[str]:
    """What `case` of _HOSTILE printed: one line per call, the exception it raised."""
    child = subprocess.run(
        [sys.executable, "-c", _HOSTILE, case], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    return child.stdout.splitlines()


@pytest.mark.parametrize("case", ["slot_base", "slot_base_set"])
def test_a_block_base_near_2_63_is_refused_not_read(case: str) -> None:
    lines = _hostile(case)
    assert len(lines) == (2 * len(available_cpu_paths()) if case == "slot_base" else 1)
    refused = "ValueError corrupted table: row 32: the index gives it a slot outside the payload"
    assert all(line.startswith(refused) for line in lines), lines


@pytest.mark.parametrize("case", ["payload_end", "payload_end_set"])
def test_a_payload_end_near_2_63_is_refused(case: str) -> None:
    [line] = _hostile(case)
    expected = rf"ValueError payload holds \d+ bytes but the index ends at {(1 << 63) - 1 - 5} "
    assert re.fullmatch(expected + r"\(\+16 pad\)", line), line


@pytest.mark.parametrize("op", ["tier_gather", "tier_pooled"])
@pytest.mark.parametrize("word_base", [1 << 40, -1])
def test_a_tier_slot_past_the_tier_is_refused_not_read(op: str, word_base: int) -> None:
    assert _hostile(f"{op} {word_base}") == [
        "ValueError corrupted table: row 3: the tier directory gives it a slot outside the tier "
        "(`ibpembed verify FILE` checks a table file's payload)"
    ]
