# SPDX-License-Identifier: Apache-2.0
"""The hot tier's budget: one setting (``--hot-tier``) saying how much host memory each table
may spend on decoded rows, and how many rows that buys (arithmetic on table sizes only, so
``ibpembed inspect`` prices a budget from file headers; the engine's tier spends it).

Accepted spellings (case and blanks do not matter):

- ``0``, ``off``, ``none``: no tier.
- ``all``: every row decoded (the table then costs its stored bytes plus its tier).
- ``5%``: 5 % of each table's raw bytes (rows x row bytes).
- ``savings``, ``50%savings``: that share of each table's savings (raw - stored bytes); at
  100 % the table with its tier takes at most its raw bytes, so compression still costs no
  memory.
- ``512MiB``, ``2GB``, ``4096``: bytes for the whole table set (KiB/MiB/GiB/TiB: powers of
  1024; KB/MB/GB/TB: of 1000; a bare number: bytes), split between tables in proportion to
  their raw bytes.

A budget that buys every row of a table (at least what ``all`` costs) is clamped to ``all`` for
that table. Negative, empty or unparsable values raise ValueError naming the accepted forms.

A budget covers everything the tier holds in host memory: its rows with their spare slots (an
eighth of a partial tier's rows, where its next versions go: ``codec.tier_spare_rows``), their
ids and directory and, for a tier that follows the traffic online, the admission policy's own
state (a :data:`StateBytes` the policy passes in), so that ``savings`` keeps its promise.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from ibpembed import codec
from ibpembed.codec import CompressedTable

BudgetKind = Literal["off", "all", "raw", "savings", "bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_PERCENT = re.compile(_NUMBER + r"%(savings)?")
_BYTES = re.compile(_NUMBER + r"([kmgt]i?b|b)?")
FORMS = "0/off, all, N% (of raw bytes), savings or N%savings, or bytes (512MiB, 2GB, 4096)"

# Host bytes an admission policy holds for a table of ``num_rows`` rows whose tier takes ``rows``
# of them; must not decrease as ``rows`` grows.
StateBytes = Callable[[int, int], int]


@dataclass(frozen=True)
class TableSize:
    """What a budget needs to know of a table (a table file's header says as much)."""

    num_rows: int
    row_bytes: int
    stored_bytes: int  # payload, index and metadata: what serving it costs without a tier

    @classmethod
    def of(cls, table: CompressedTable) -> TableSize:
        return cls(table.num_rows, table.row_bytes, table.resident_bytes)

    @property
    def raw_bytes(self) -> int:
        return self.num_rows * self.row_bytes


@dataclass(frozen=True)
class TierPlan:
    """What a budget buys one table: its tier's rows, their host bytes, and the host bytes of
    the admission policy's state for the table (0 for a tier chosen offline)."""

    rows: int
    bytes: int
    state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes + self.state_bytes


@dataclass(frozen=True)
class TierBudget:
    """A parsed ``--hot-tier`` value.

    Attributes
    ----------
    kind : ``off``, ``all``, ``raw`` (a share of raw bytes), ``savings`` (a share of the
        savings) or ``bytes`` (for the whole table set).
    value : the share (``raw``, ``savings``; 0.05 for 5 %) or the bytes (``bytes``).
    """

    kind: BudgetKind
    value: float = 0.0

    @classmethod
    def parse(cls, text: str | TierBudget, *, setting: str = "hot tier") -> TierBudget:
        """``text`` as a budget (a budget is returned as it is); ValueError when malformed,
        naming the ``setting``."""
        if isinstance(text, TierBudget):
            return text
        if isinstance(text, float):  # 0.05 would read as 0.05 bytes: off, not 5 %
            raise ValueError(f"{setting} budget {text!r} is a float; spell it as one of: {FORMS}")
        spelt = "".join(str(text).split()).lower()
        if spelt in ("off", "none"):
            return cls("off")
        if spelt == "all":
            return cls("all")
        if spelt == "savings":
            return cls("savings", 1.0)
        if spelt.startswith("-"):
            raise ValueError(f"{setting} budget must not be negative, got {text!r} ({FORMS})")
        percent = _PERCENT.fullmatch(spelt)
        if percent is not None:
            share = float(percent.group(1)) / 100
            if not math.isfinite(share):
                raise ValueError(f"{setting} budget {text!r} is too large ({FORMS})")
            if share == 0:
                return cls("off")
            return cls("savings" if percent.group(2) else "raw", share)
        size = _BYTES.fullmatch(spelt)
        if size is None:
            raise ValueError(f"{setting} budget {text!r} is not one of: {FORMS}")
        unit = size.group(2) or ""
        count = float(size.group(1)) * _UNITS[unit]
        if not math.isfinite(count):
            raise ValueError(f"{setting} budget {text!r} is too large ({FORMS})")
        if count == 0:
            return cls("off")
        # A config file or environment variable hands a share written as 0.05 over as text:
        # read as bytes it would silently turn the tier off.
        if count < 1 or (not unit and count != int(count)):
            raise ValueError(
                f"{setting} budget {text!r} is a fraction of a byte; a share is written with "
                f"a percent sign (5%, 50%savings) ({FORMS})"
            )
        return cls("bytes", count)

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    def table_bytes(self, size: TableSize, share: float, state: StateBytes | None = None) -> int:
        """Bytes a table may spend on its tier, the policy's ``state`` included; ``share``: its
        part of the table set's raw bytes (what a ``bytes`` budget is split by)."""
        if self.kind == "off":
            return 0
        if self.kind == "all":
            every = size.num_rows
            extra = state(every, every) if state is not None else 0
            return tier_cost(every, size.row_bytes, every) + extra
        if self.kind == "raw":
            return int(self.value * size.raw_bytes)
        if self.kind == "savings":
            return int(self.value * max(size.raw_bytes - size.stored_bytes, 0))
        return int(self.value * share)

    def table_rows(self, size: TableSize, share: float, state: StateBytes | None = None) -> int:
        """Rows a table's tier holds: ``num_rows`` for ``all`` and for every budget that buys
        at least the whole table (the clamp); ``state``: the admission policy's, paid from the
        same budget."""
        budget = self.table_bytes(size, share, state)
        return capacity_rows(size.num_rows, size.row_bytes, budget, state)

    def plan(
        self, sizes: Mapping[str, TableSize], state: StateBytes | None = None
    ) -> dict[str, TierPlan]:
        """What the budget buys each table of a table set (with ``state``: an online policy's
        state paid from the budget and counted in each plan)."""
        total = sum(s.raw_bytes for s in sizes.values()) or 1
        out = {}
        for name, size in sizes.items():
            rows = self.table_rows(size, size.raw_bytes / total, state)
            held = state(size.num_rows, rows) if state is not None and self.enabled else 0
            out[name] = TierPlan(rows, tier_cost(size.num_rows, size.row_bytes, rows), held)
        return out

    def describe(self) -> str:
        """The budget as an operator reads it (the banner)."""
        if self.kind in ("off", "all"):
            return self.kind
        if self.kind == "bytes":
            return f"{_human_bytes(self.value)} for the table set"
        what = "raw bytes" if self.kind == "raw" else "savings"
        return f"{100 * self.value:g}% of each table's {what}"


def _human_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1 (4,096 -> 4 KiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.4g} {unit}"
    return f"{count:,.0f} bytes"


def tier_cost(num_rows: int, row_bytes: int, rows: int) -> int:
    """Host bytes of a tier of ``rows`` rows (0 for none) of a table of ``num_rows``."""
    if rows <= 0:
        return 0
    return codec.tier_bytes_for(num_rows, row_bytes, rows)


def capacity_rows(
    num_rows: int, row_bytes: int, budget_bytes: int, state: StateBytes | None = None
) -> int:
    """Most rows (``num_rows`` at most) whose tier, with the policy's ``state`` for it, costs
    at most ``budget_bytes``."""
    extra = None if state is None else functools.partial(state, num_rows)
    return codec.tier_rows_within(num_rows, row_bytes, budget_bytes, extra)
