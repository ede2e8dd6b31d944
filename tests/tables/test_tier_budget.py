# SPDX-License-Identifier: Apache-2.0
"""``--hot-tier`` budgets: every spelling, the clamp to ``all``, clear errors, and what each
buys a table."""

from __future__ import annotations

import pytest

from ibpembed.tables.tier_budget import (
    TableSize,
    TierBudget,
    TierPlan,
    capacity_rows,
    tier_cost,
)

ROWS, ROW_BYTES = 10_000, 512
SIZE = TableSize(ROWS, ROW_BYTES, stored_bytes=3_500_000)  # raw 5,120,000


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("0", "off", 0.0),
        ("off", "off", 0.0),
        (" None ", "off", 0.0),
        ("0%", "off", 0.0),
        ("all", "all", 0.0),
        ("ALL", "all", 0.0),
        ("5%", "raw", 0.05),
        ("0.5 %", "raw", 0.005),
        ("savings", "savings", 1.0),
        ("100%savings", "savings", 1.0),
        ("50%Savings", "savings", 0.5),
        ("4096", "bytes", 4096.0),
        ("512MiB", "bytes", 512 * 2**20),
        ("2GB", "bytes", 2e9),
        ("1.5 GiB", "bytes", 1.5 * 2**30),
        ("64kb", "bytes", 64_000.0),
        ("0.3KiB", "bytes", 0.3 * 2**10),
    ],
)
def test_every_spelling_parses(text: str, kind: str, value: float) -> None:
    budget = TierBudget.parse(text)
    assert (budget.kind, budget.value) == (kind, pytest.approx(value))
    assert TierBudget.parse(budget) is budget


@pytest.mark.parametrize(
    "text",
    [
        "-1",
        "-5%",
        "- 2GB",
        "",
        "lots",
        "5%%",
        "1e3",
        "5 % of raw",
        "%",
        "9" * 400,
        "1" + "0" * 400 + "%",
        "0.05",
        "0.5b",
        "1.5",
        "0.0001kb",
    ],
)
def test_bad_budgets_name_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="hot tier budget") as error:
        TierBudget.parse(text)
    assert "512MiB" in str(error.value) and "savings" in str(error.value)


def test_capacity_is_what_the_bytes_buy_and_clamps_at_every_row() -> None:
    one, two = tier_cost(ROWS, ROW_BYTES, 1), tier_cost(ROWS, ROW_BYTES, 2)
    assert tier_cost(ROWS, ROW_BYTES, 0) == 0
    assert capacity_rows(ROWS, ROW_BYTES, one - 1) == 0
    assert capacity_rows(ROWS, ROW_BYTES, one) == 1
    assert capacity_rows(ROWS, ROW_BYTES, two - 1) == 1
    everything = tier_cost(ROWS, ROW_BYTES, ROWS)
    # A tier of every row needs no directory, so a byte less buys the most rows a directory
    # leaves room for, not ROWS - 1.
    short = capacity_rows(ROWS, ROW_BYTES, everything - 1)
    assert short < ROWS
    assert tier_cost(ROWS, ROW_BYTES, short) <= everything - 1
    assert tier_cost(ROWS, ROW_BYTES, short + 1) > everything - 1
    assert capacity_rows(ROWS, ROW_BYTES, everything) == ROWS
    assert capacity_rows(ROWS, ROW_BYTES, 10**15) == ROWS
    assert capacity_rows(0, ROW_BYTES, 10**6) == 0 and capacity_rows(ROWS, ROW_BYTES, -5) == 0


def test_what_each_kind_buys_a_table() -> None:
    raw, saved = SIZE.raw_bytes, SIZE.raw_bytes - SIZE.stored_bytes
    ten = TierBudget.parse("10%").plan({"t": SIZE})["t"]
    assert ten.bytes <= raw // 10 < tier_cost(ROWS, ROW_BYTES, ten.rows + 1)
    savings = TierBudget.parse("savings").plan({"t": SIZE})["t"]
    assert SIZE.stored_bytes + savings.bytes <= raw  # with its tier, no bigger than raw
    assert tier_cost(ROWS, ROW_BYTES, savings.rows + 1) > saved
    half = TierBudget.parse("50%savings").plan({"t": SIZE})["t"]
    assert half.bytes <= saved // 2 and half.rows < savings.rows
    every = TierPlan(ROWS, tier_cost(ROWS, ROW_BYTES, ROWS))
    assert TierBudget.parse("all").plan({"t": SIZE})["t"] == every
    assert TierBudget.parse("400%").plan({"t": SIZE})["t"] == every  # the clamp
    assert TierBudget.parse("off").plan({"t": SIZE})["t"] == TierPlan(0, 0)
    incompressible = TableSize(ROWS, ROW_BYTES, stored_bytes=raw + 1)
    assert TierBudget.parse("savings").plan({"t": incompressible})["t"] == TierPlan(0, 0)


def test_tables_of_one_or_two_rows_are_priced_without_dividing_by_zero() -> None:
    # 8-byte rows: a tier row costs its bytes and its id, a partial tier a directory besides.
    for num_rows in (1, 2, 3):
        every = tier_cost(num_rows, 8, num_rows)
        assert capacity_rows(num_rows, 8, every) == num_rows
        for budget in range(every):
            rows = capacity_rows(num_rows, 8, budget)
            assert rows < num_rows and tier_cost(num_rows, 8, rows) <= budget
            assert tier_cost(num_rows, 8, rows + 1) > budget or rows + 1 == num_rows


def _state(num_rows: int, rows: int) -> int:
    """A policy's state: a fixed buffer and a step every 64 rows, as a sketch's width steps."""
    return 0 if rows == 0 else 4096 + 24 * rows + 512 * (rows // 64)


@pytest.mark.parametrize("budget", [0, 4095, 5000, 20_000, 300_000, 5_200_000, 10**9])
def test_a_policy_state_is_paid_from_the_budget(budget: int) -> None:
    rows = capacity_rows(ROWS, ROW_BYTES, budget, _state)
    cost = [tier_cost(ROWS, ROW_BYTES, k) + _state(ROWS, k) for k in range(ROWS + 1)]
    assert rows == max(k for k in range(ROWS + 1) if k == 0 or cost[k] <= budget)
    plan = TierBudget.parse(str(budget) if budget else "0").plan({"t": SIZE}, _state)["t"]
    assert plan == TierPlan(rows, tier_cost(ROWS, ROW_BYTES, rows), _state(ROWS, rows))
    assert plan.total_bytes <= budget or plan.rows == ROWS
    # With savings, the table with its tier and the policy stays within its raw bytes.
    savings = TierBudget.parse("savings").plan({"t": SIZE}, _state)["t"]
    assert SIZE.stored_bytes + savings.total_bytes <= SIZE.raw_bytes
    assert savings.rows < TierBudget.parse("savings").plan({"t": SIZE})["t"].rows


def test_a_byte_budget_is_split_between_tables_by_raw_bytes() -> None:
    big, small = TableSize(30_000, ROW_BYTES, 10**7), TableSize(10_000, ROW_BYTES, 3 * 10**6)
    plan = TierBudget.parse("8MiB").plan({"big": big, "small": small})
    assert plan["big"].bytes + plan["small"].bytes <= 8 * 2**20
    assert plan["big"].rows == capacity_rows(30_000, ROW_BYTES, 6 * 2**20)
    assert plan["small"].rows == capacity_rows(10_000, ROW_BYTES, 2 * 2**20)


def test_describe_reads_as_the_operator_wrote_it() -> None:
    assert TierBudget.parse("5%").describe() == "5% of each table's raw bytes"
    assert TierBudget.parse("savings").describe() == "100% of each table's savings"
    assert TierBudget.parse("512MiB").describe() == "512 MiB for the table set"
    assert TierBudget.parse("4096").describe() == "4 KiB for the table set"
    assert TierBudget.parse("1000").describe() == "1,000 bytes for the table set"
    assert TierBudget.parse("1.5GiB").describe() == "1.5 GiB for the table set"
    assert TierBudget.parse("all").describe() == "all"
