# SPDX-License-Identifier: Apache-2.0
"""Fit, compress and look up IBP-compressed tables.

>>> table = compress(weights)                      # [N, D] fp32/fp16/bf16/int8/uint8
>>> table.gather(torch.tensor([3, 1, 3]))          # rows, bit-exact
>>> table.lookup(ids, offsets, pooling="mean")     # [B, D] fp32, like nn.EmbeddingBag

Rows are bits to the codec: any dtype round-trips bit for bit (NaN payloads and -0.0 included).
The layout is documented in csrc/include/ibpembed/format.h.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from ibpembed import _C, layout
from ibpembed._ops import ops
from ibpembed.codec_options import (
    CHUNK_BITS_CHOICES,
    CODE_BITS_CHOICES,
    DEFAULT_ALIGN,
    DEFAULT_SAMPLE_ROWS,
)
from ibpembed.layout import (
    BITMASK_WORD_ROWS,
    DTYPE_CODES,
    INT8_ROWWISE_CODE,
    INT8_ROWWISE_HEADER_BYTES,
    MAX_SLOT_UNIT,
    MAX_UNITS_PER_ROW,
    POOLING_CODES,
    ROWS_PER_BLOCK,
    TIER_WORD_ROWS,
)

Method = Literal["ibpembed", "paper", "raw"]
Pooling = Literal["sum", "mean"]

# A decoded tier keeps this fraction of its rows as spare slots (tier_spare_rows).
TIER_SPARE_FRACTION = 8

# (chunk_bits, code_bits) layouts the fit compares, in classes of equal decode speed, fastest
# first: wider chunks decode more bytes per step, and C = 1 (plain IBP) needs no codebook lookup
# per chunk; within a class the code width barely changes the decode cost. Codebooks (C > 1) are
# tried on chunks of one fp32 or two 16-bit elements, where a chunk's masked bits are one or two
# exponents whose few frequent values a short code captures.
FIT_LAYOUT_CLASSES = (
    ((64, 1),),
    ((32, 1),),
    ((16, 1),),
    ((32, 2), (32, 3), (32, 4)),
    ((16, 2), (16, 3), (16, 4)),
)
# The smallest layout of a class wins it; a faster class is kept unless a slower one saves more
# than this fraction of the raw bytes.
FASTER_LAYOUT_SLACK = 0.01
WIDTH_PROBE_ROWS = 65_536  # rows on which the chunk width is chosen
_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
_POOLABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cpu_path() -> str:
    """The CPU codec path in use: ``"avx512"`` (bmi2, plus vector loops that decode codebook
    tables and size rows of 32-bit chunks), ``"bmi2"`` (pext/pdep) or ``"ref"`` (portable
    scalar)."""
    return _C.cpu_path()


def pattern_lookup() -> str:
    """How the ``avx512`` path's codebook decoder finds each chunk's pattern: ``"gather"`` (one
    vector gather per 16 chunks; the default on Intel CPUs) or ``"tables"`` (byte-table
    shuffles; the default elsewhere). ``IBPEMBED_PATTERN_LOOKUP`` overrides it."""
    return _C.pattern_lookup()


def serve_payload_bytes(nbytes: int) -> None:
    """Tell CPU lookups how many payload bytes this process serves: beyond the last-level cache,
    every table larger than the L2 cache copies its rows into a stage before decoding them
    instead of prefetching them, as a table larger than the cache alone always does (DRAM reads
    queue behind prefetches; docs/codec.md). ``IBPEMBED_STAGE_MIN_BYTES`` overrides both."""
    _C.set_served_payload_bytes(nbytes)


def available_cpu_paths() -> list[str]:
    """The CPU paths this machine runs, the default first (the path chosen when
    ``IBPEMBED_CPU_PATH`` is unset), then the others fastest first."""
    runs = {"avx512": _C.cpu_has_avx512(), "bmi2": _C.cpu_has_bmi2(), "ref": True}
    default = _C.default_cpu_path()
    return [default] + [path for path, ok in runs.items() if ok and path != default]


def slot_unit_candidates(row_bytes: int, align: int | None) -> list[int]:
    """Slot units ``compress`` may use, finest first.

    With ``align`` given: the one unit that honours it. Otherwise every power of two up to 64
    that divides the row width (so raw rows carry no padding: an incompressible table costs raw
    + index + metadata, nothing more) and keeps a raw row within MAX_UNITS_PER_ROW units; the
    finest valid unit when none divides. The fit then keeps the one that stores the sample
    smallest.
    """
    if align is not None:
        return [slot_unit_bytes(row_bytes, align)]
    finest = slot_unit_bytes(row_bytes, 1)
    dividing = [u for u in (1, 2, 4, 8, 16, 32, 64) if u >= finest and row_bytes % u == 0]
    return dividing or [finest]


def slot_unit_bytes(row_bytes: int, align: int) -> int:
    """Smallest power of two >= align in which a raw row spans at most MAX_UNITS_PER_ROW units
    (format.h slot_unit_bytes)."""
    unit = 1
    while unit < align:
        unit <<= 1
    while layout.ceil_div(row_bytes, unit) > MAX_UNITS_PER_ROW:
        unit <<= 1
    return unit


class TableArgs(NamedTuple):
    """A compressed table as every op takes it, in the order of csrc/ops/ops.h: six tensors, then
    four ints (``ops.ibp_gather(*table.op_args(), ids)``). ``_replace`` swaps fields, e.g. the
    tensors of a table placed on a GPU."""

    payload: torch.Tensor  # uint8 [stored bytes + pad]
    block_base: torch.Tensor  # int64 [ceil(N / 32) + 1]
    row_units: torch.Tensor  # uint8 [ceil(N / 32) * 32]
    bitmask: torch.Tensor  # int32 [ceil(N / 32)]
    mask: torch.Tensor  # int64 [V]
    bitval: torch.Tensor  # int64 [V * (2^C - 1)]
    chunk_bits: int
    row_bytes: int
    unit_bytes: int
    num_rows: int


@dataclass(frozen=True, eq=False)
class HotRows:
    """A table's decoded tier: some of its rows held decoded at a fixed stride, which CPU lookups
    read in place of the payload, found without the compact index (format.h
    ``TableView::tier_slot``; build it with ``CompressedTable.with_hot_rows``).

    A cache in all but name: it holds nothing the payload does not, costs ``bytes`` of host
    memory, and pays off on skewed traffic, where a small set of rows serves most lookups. Pooled
    lookups resolve a batch's ids to tier rows first, pool those in a lean loop and decode only
    the misses; a tier of every row (``directory`` empty) never reads the payload at all.
    """

    ids: torch.Tensor  # int64 [K], sorted, distinct: the rows in the tier
    # int64 [ceil(N / 64) * 2], a rank directory: per 64 rows a bit word (set = in the tier),
    # then the slot of the word's first held row, so row r sits at rows[base + popcount(lower
    # bits)]; empty [0] when the tier holds every row (row r at rows[r]). A fresh tier's bases
    # count the rows before each word (row ids[k] at k); a new version of it moves the words
    # it changes to slots past the others (tables/tier_versions.py).
    directory: torch.Tensor
    rows: torch.Tensor  # uint8 [slots >= K, row_bytes], the head of a buffer (see ``bytes``)
    # Share of the traffic sample that chose these rows which they served; 0 when unknown.
    # Lookup planning reads it (LookupEngine), decoding never does.
    coverage: float = 0.0

    @property
    def count(self) -> int:
        return self.ids.numel()

    @property
    def bytes(self) -> int:
        """Host memory of the tier: the decoded rows (with the buffer's spare slots, which new
        versions of the tier fill: tables/tier_versions.py), their ids and the directory."""
        rows = self.rows.untyped_storage().nbytes() if self.rows.numel() else 0
        return rows + 8 * (self.ids.numel() + self.directory.numel())

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """int64: the slot in ``rows`` of each of ``ids`` (rows the tier holds), read from the
        directory as the ops read it (csrc/include/ibpembed/tier.h ``rank_slot``)."""
        if self.directory.numel() == 0:
            return ids.clone()
        word = torch.div(ids, TIER_WORD_ROWS, rounding_mode="floor")
        below = torch.searchsorted(self.ids, ids) - torch.searchsorted(
            self.ids, word * TIER_WORD_ROWS
        )
        return self.directory[2 * word + 1] + below


def tier_directory_bytes(num_rows: int) -> int:
    """Bytes of a tier's rank directory: two 8-byte words per TIER_WORD_ROWS table rows."""
    return 16 * layout.ceil_div(num_rows, TIER_WORD_ROWS)


def tier_spare_rows(num_rows: int, count: int) -> int:
    """Spare slots a tier of ``count`` rows of a table of ``num_rows`` keeps past its rows, for
    the words its next versions change (row updates, refreshes: tables/tier_versions.py): an
    eighth of its rows. A tier of every row has none as built: refreshes never change it, and
    its first row update gives it some (priced by no budget: ``all`` has none to keep)."""
    return 0 if count == num_rows else count // TIER_SPARE_FRACTION


def tier_bytes_for(num_rows: int, row_bytes: int, count: int) -> int:
    """Host bytes of a decoded tier of ``count`` rows of a table of ``num_rows`` rows (what
    ``HotRows.bytes`` will be): the rows with their spare slots (``tier_spare_rows``) and their
    ids, plus the directory (``tier_directory_bytes``) unless the tier holds every row
    (``count == num_rows``). Prices any count >= 0, so that a caller may difference it."""
    if count < 0:
        raise ValueError(f"a tier holds at least 0 rows, got {count}")
    if count == 0:
        return 0
    directory = 0 if count == num_rows else tier_directory_bytes(num_rows)
    spare = tier_spare_rows(num_rows, count) * row_bytes
    return count * (row_bytes + 8) + spare + directory


def tier_rows_within(
    num_rows: int, row_bytes: int, budget_bytes: int, extra: Callable[[int], int] | None = None
) -> int:
    """The most rows (``num_rows`` at most) whose tier (``tier_bytes_for``), plus ``extra(rows)``
    bytes if given (non-decreasing in the rows), costs at most ``budget_bytes``."""

    def cost(rows: int) -> int:
        return tier_bytes_for(num_rows, row_bytes, rows) + (extra(rows) if extra else 0)

    if budget_bytes <= 0 or num_rows == 0:
        return 0
    # Every row needs no directory, so it may cost less than every row but one: tried first.
    if cost(num_rows) <= budget_bytes:
        return num_rows
    low, high = 0, num_rows - 1  # low fits (or is 0), high + 1 does not
    while low < high:
        mid = (low + high + 1) // 2
        if cost(mid) <= budget_bytes:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True, eq=False)
class CompressedTable:
    """A compressed [num_rows, dim] table in the compact layout of format.h.

    The tensors are the whole table; the ints say how to read them. ``quant="int8_rowwise"`` marks
    uint8 rows in fbgemm's row-wise int8 layout (fp16 scale, fp16 bias, then dim - 4 codes), which
    pooled lookups dequantise.
    """

    payload: torch.Tensor  # uint8 [stored bytes + 16 pad]
    block_base: torch.Tensor  # int64 [ceil(N / 32) + 1]
    row_units: torch.Tensor  # uint8 [ceil(N / 32) * 32]
    bitmask: torch.Tensor  # int32 [ceil(N / 32)], bit set = row stored compressed
    mask: torch.Tensor  # int64 [V], uint64 bit patterns
    bitval: torch.Tensor  # int64 [V * (2^C - 1)], the codebooks (C = 1: one pattern each)
    chunk_bits: int
    num_rows: int
    dim: int
    dtype: torch.dtype
    unit_bytes: int
    quant: str | None = None
    # The decoded tier read by CPU lookups (None: every row is read from the payload).
    hot: HotRows | None = None

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    @property
    def raw_bytes(self) -> int:
        """Bytes of the uncompressed table."""
        return self.num_rows * self.row_bytes

    @property
    def payload_bytes(self) -> int:
        return self.payload.numel()

    @property
    def index_bytes(self) -> int:
        """Random-access index: per-block bases and per-row slot sizes."""
        return self.block_base.numel() * 8 + self.row_units.numel()

    @property
    def metadata_bytes(self) -> int:
        """The compressed-row bitmask and the per-position masks."""
        return self.bitmask.numel() * 4 + (self.mask.numel() + self.bitval.numel()) * 8

    @property
    def stored_bytes(self) -> int:
        """Everything needed to decode: payload + index + bitmask + masks."""
        return self.payload_bytes + self.index_bytes + self.metadata_bytes

    @property
    def resident_payload_bytes(self) -> int:
        """The whole buffer the payload views: the spare room a row update's spill buffer keeps
        is resident too."""
        return max(self.payload_bytes, self.payload.untyped_storage().nbytes())

    @property
    def resident_bytes(self) -> int:
        """``stored_bytes`` with the payload's whole buffer (:attr:`resident_payload_bytes`)."""
        return self.resident_payload_bytes + self.index_bytes + self.metadata_bytes

    @property
    def savings(self) -> float:
        """1 - stored / raw (negative only for tiny tables, where metadata dominates)."""
        return layout.savings(self.stored_bytes, self.raw_bytes)

    @property
    def hot_bytes(self) -> int:
        """Host memory of the decoded tier (0 without one); not part of ``stored_bytes``."""
        return self.hot.bytes if self.hot is not None else 0

    @property
    def tier_bytes(self) -> int:
        """Host memory of the decoded tier (``hot_bytes``): the table then takes
        ``stored_bytes + tier_bytes`` of host memory."""
        return self.hot_bytes

    @property
    def tier_rows(self) -> int:
        """Rows in the decoded tier (0 without one)."""
        return self.hot.count if self.hot is not None else 0

    def tier_capacity_rows(self, budget_bytes: int) -> int:
        """The most rows a decoded tier of at most ``budget_bytes`` holds (see
        ``tier_bytes_for``): 0 for a budget below one row plus the directory, ``num_rows`` for
        one that covers every row (which needs no directory, so it can cost less than every row
        but one with it). A budget past the whole table is
        clamped to it; a negative or non-integer budget is a ValueError / TypeError.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        return tier_rows_within(self.num_rows, self.row_bytes, budget_bytes)

    @property
    def poolable(self) -> bool:
        """Whether pooled lookups (SUM/MEAN) read this table: float rows, or fbgemm row-wise
        int8 rows (``quant="int8_rowwise"``); other rows only come back as they are."""
        return self.quant == "int8_rowwise" or self.dtype in _POOLABLE_DTYPES

    @property
    def pooled_dim(self) -> int:
        """Width of the table's pooled rows (an int8_rowwise row loses its scale and bias)."""
        return self.dim - INT8_ROWWISE_HEADER_BYTES if self.quant == "int8_rowwise" else self.dim

    @property
    def code_bits(self) -> int:
        """C of format.h: 1 for plain IBP, 2..4 for exponent-aware codebooks."""
        return code_bits_of(self.mask, self.bitval)

    @property
    def compressed_rows(self) -> int:
        """Rows stored compressed (the rest are stored raw)."""
        bits = torch.bitwise_and(self.bitmask.view(torch.uint8)[:, None], _BIT_WEIGHTS)
        return int(bits.ne(0).sum())

    @property
    def dtype_code(self) -> int:
        """The ops' ``dtype`` argument of pooled lookups (``layout.DTYPE_CODES``, or
        ``INT8_ROWWISE_CODE`` for ``quant="int8_rowwise"``); a TypeError for int8/uint8 rows
        without a scale, which cannot be pooled."""
        if self.quant == "int8_rowwise":
            return INT8_ROWWISE_CODE
        if self.dtype in (torch.uint8, torch.int8):
            raise TypeError(
                f"{self.dtype} rows without a scale cannot be pooled; compress fbgemm row-wise "
                "int8 rows with quant='int8_rowwise'"
            )
        return DTYPE_CODES[self.dtype]

    # -- decoding ------------------------------------------------------------------------------
    def op_args(self) -> TableArgs:
        """The table as every op takes it: ``ops.ibp_gather(*table.op_args(), ids)``."""
        return TableArgs(
            self.payload,
            self.block_base,
            self.row_units,
            self.bitmask,
            self.mask,
            self.bitval,
            self.chunk_bits,
            self.row_bytes,
            self.unit_bytes,
            self.num_rows,
        )

    def _tier_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The op's tier arguments (tier_dir, tier_rows): the decoded tier, or for a table
        whose every row is stored raw at one stride its own payload, read as a tier of every
        row (the lean path of raw rows), or none."""
        if self.hot is not None:
            return self.hot.directory, self.hot.rows
        return self._raw_rows_as_tier

    @functools.cached_property
    def _raw_rows_as_tier(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # Once per table object (a table never changes): O(N) checks of the index.
        slot = self.unit_bytes * -(-self.row_bytes // self.unit_bytes)
        n = self.num_rows
        bases = torch.arange(self.block_base.numel() - 1, dtype=torch.int64) * (
            ROWS_PER_BLOCK * slot
        )
        dense = (
            self.payload.numel() >= n * slot
            and bool(self.row_units[:n].eq(slot // self.unit_bytes).all())
            and bool(self.block_base[:-1].eq(bases).all())
        )
        if not dense:
            return None, None
        rows = self.payload[: n * slot].view(n, slot)
        return torch.empty(0, dtype=torch.int64), rows

    def _as_rows(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.view(self.dtype).view(raw.shape[0], self.dim)

    def decompress(self) -> torch.Tensor:
        """The whole table, bit-exact, as a new [num_rows, dim] tensor of the source dtype."""
        return self._as_rows(ops.ibp_decompress(*self.op_args()))

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any order, duplicates allowed), bit-exact, as [len(ids), dim]."""
        indices = _as_indices(ids, "ids")
        return self._as_rows(ops.ibp_gather(*self.op_args(), indices, *self._tier_args()))

    def lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        pooling: Pooling = "sum",
        *,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled lookup over a CSR batch, like ``nn.EmbeddingBag`` / torchrec.

        Parameters
        ----------
        ids : [nnz] integer row ids.
        offsets : [B + 1] bag boundaries (``offsets[0] == 0``, ``offsets[-1] == nnz``).
        weights : optional [nnz] float32 per-sample weights.
        pooling : ``"sum"`` or ``"mean"`` (weighted sum divided by the bag length).
        lengths : [B] bag lengths, instead of ``offsets``.

        Returns
        -------
        [B, D] float32, accumulated in fp32; empty bags give zeros.
        """
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        dtype_code = self.dtype_code
        indices = _as_indices(ids, "ids")
        offsets = _as_offsets(offsets, lengths)
        if weights is not None:
            if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32:
                raise TypeError("weights must be a float32 tensor")
            weights = weights.contiguous()
        return ops.lookup_pooled(
            *self.op_args(),
            indices,
            offsets,
            weights,
            dtype_code,
            POOLING_CODES[pooling],
            *self._tier_args(),
        )

    # -- decoded tier ----------------------------------------------------------------------------
    def with_hot_rows(
        self, ids: torch.Tensor, *, coverage: float = 0.0, spare_rows: int | None = None
    ) -> CompressedTable:
        """This table with a decoded tier of rows ``ids`` for CPU lookups (replacing any earlier
        one): those rows are then read decoded, found without the index, in a lean loop. Rows
        stored raw are taken too (the tier spares them the index); ids covering every row give a
        tier without a directory. An empty selection, or a table whose rows are all stored raw
        at one stride (its payload already serves as such a tier), gives a table without one.
        The payload and index are shared, not copied: the result is a new table object, so a
        lookup holding the old one keeps reading the old tier (build aside, publish by swapping).
        ``coverage``: see ``HotRows``. ``spare_rows``: slots past the rows for the tier's next
        versions (tables/tier_versions.py; default ``tier_spare_rows``). Its host memory:
        ``tier_bytes_for``.
        """
        ids = self.tier_selection(ids)
        if spare_rows is None:
            spare_rows = tier_spare_rows(self.num_rows, ids.numel())
        elif spare_rows < 0:
            raise ValueError(f"spare_rows must be >= 0, got {spare_rows}")
        base = self.without_hot_rows()
        if ids.numel() == 0 or base._raw_rows_as_tier[1] is not None:
            return base
        directory = ids.new_empty(0) if ids.numel() == self.num_rows else self.rank_directory(ids)
        # Read through the current tier: a rebuild that keeps most rows copies them instead of
        # decoding them again. The spare slots past the rows (their contents written before any
        # version reads them) come from the same call, on huge pages like the rows.
        spare = ids[:1].expand(spare_rows)
        buffer = ops.ibp_gather(*self.op_args(), torch.cat([ids, spare]), *self._tier_args())
        rows = buffer[: ids.numel()]
        return dataclasses.replace(self, hot=HotRows(ids, directory, rows, coverage))

    def tier_selection(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` as a tier's rows: int64, sorted, distinct (IndexError outside the table)."""
        ids = _as_indices(ids, "ids")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise IndexError(f"hot row ids must lie in [0, {self.num_rows})")
        return torch.unique(ids)  # sorted: a tier's words hold their rows in row order

    def rank_directory(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank directory of a tier holding the sorted distinct ``ids`` (HotRows.directory,
        and the HBM tier's residency map): int64 [2 * ceil(num_rows / 64)], per 64 table rows a
        bit word (bit r % 64: the tier holds row r) and the tier slot of the word's first held
        row (csrc/include/ibpembed/tier.h ``rank_slot``)."""
        words = layout.ceil_div(self.num_rows, TIER_WORD_ROWS)
        word = torch.div(ids, TIER_WORD_ROWS, rounding_mode="floor")
        # Distinct bits of a word never carry, so their sum is their OR (bit 63 wraps to the
        # sign bit, which is what the uint64 reading of the word wants).
        bits = torch.zeros(words, dtype=torch.int64).index_add_(
            0, word, torch.bitwise_left_shift(torch.ones_like(ids), ids - word * TIER_WORD_ROWS)
        )
        per_word = torch.bincount(word, minlength=words)
        before = torch.cumsum(per_word, 0) - per_word
        return torch.stack([bits, before], dim=1).flatten().contiguous()

    def without_hot_rows(self) -> CompressedTable:
        """This table without a decoded tier (itself when it has none)."""
        return self if self.hot is None else dataclasses.replace(self, hot=None)

    def is_compressed(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool [len(ids)]: whether each row (ids int64, in range) is stored compressed."""
        words = self.bitmask[torch.div(ids, BITMASK_WORD_ROWS, rounding_mode="floor")]
        bits = torch.bitwise_right_shift(words.to(torch.int64), ids % BITMASK_WORD_ROWS)
        return torch.bitwise_and(bits, 1).bool()


class CompressedTableSet:
    """Tables registered once with the native op, for pooled lookups of several of them in one
    call (``torch.ops.ibpembed.lookup_pooled_tables``): CPU tables, or tables placed for one GPU
    (``tables.placement.place_table``), whose lookups then run as one kernel launch per chunk
    width, ids and offsets on that GPU.

    One ``CompressedTable.lookup`` per table costs ~15 us of dispatch and checks, more than the
    decoding of a B=1 request's few rows; a request that reads 26 tables pays it once here. The
    set holds references to the tables' memory, so build one per table version.

    Parameters
    ----------
    tables : poolable tables of one device (float rows, or ``quant="int8_rowwise"``), with their
        decoded tiers (read on the CPU only); table ``k`` of a call is
        ``tables[table_bags[k, 0]]``.
    """

    def __init__(self, tables: Sequence[CompressedTable]) -> None:
        self.tables = tuple(tables)
        self._handle = torch.classes.ibpembed.TableSet()
        for table in self.tables:
            self._handle.add(*table.op_args(), table.dtype_code, *table._tier_args())

    def __len__(self) -> int:
        return len(self.tables)

    def lookup(
        self,
        table_bags: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        pooling: Pooling = "sum",
    ) -> tuple[list[torch.Tensor], list[float]]:
        """Pooled lookups over one CSR batch (``ids``, ``offsets``, optional ``weights`` as in
        :meth:`CompressedTable.lookup`). Row ``k`` of ``table_bags`` (int64 [K, 3]) is
        (position in the set, first bag, bag count): table ``k`` of the call is that table and
        pools those bags of the batch, whose ids it holds.

        Returns each table's [bag count, D] fp32 result, and the seconds each table's part
        took (on a GPU, the call's time shared out by bags: one launch serves every table). On
        the CPU every id is checked (``IndexError``) before any table is read; on a GPU the
        kernels check them and the call raises the same errors.
        """
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if weights is not None and (
            not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32
        ):
            raise TypeError("weights must be a float32 tensor")
        if table_bags.dtype not in _INT_DTYPES:
            raise TypeError(f"table_bags must be an integer tensor, got {table_bags.dtype}")
        if table_bags.dtype != torch.int64 or not table_bags.is_contiguous():
            table_bags = table_bags.to(torch.int64).contiguous()
        values, seconds = ops.lookup_pooled_tables(
            self._handle,
            _as_indices(ids, "ids"),
            _as_indices(offsets, "offsets"),
            table_bags,
            None if weights is None else weights.contiguous(),
            POOLING_CODES[pooling],
        )
        return values, seconds.tolist()


def _as_indices(ids: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype == torch.int64 and ids.is_contiguous():
        # The common case, per table per request: a no-op .to().contiguous() still costs ~3 us
        # of dispatch, a tenth of a B=1 table lookup.
        return ids
    return ids.to(torch.int64).contiguous()


def _as_offsets(offsets: torch.Tensor | None, lengths: torch.Tensor | None) -> torch.Tensor:
    if (offsets is None) == (lengths is None):
        raise ValueError("pass exactly one of offsets or lengths")
    if offsets is not None:
        return _as_indices(offsets, "offsets")
    assert lengths is not None  # exactly one of the two is given (checked above)
    lengths = _as_indices(lengths, "lengths")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be non-negative")
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def validate_table(table: torch.Tensor, quant: str | None = None) -> None:
    """Raise TypeError/ValueError unless ``table`` is something ``compress`` accepts."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d) for d in DTYPE_CODES)
        raise TypeError(f"unsupported table dtype {table.dtype}; supported: {supported}")
    if table.dim() != 2:
        raise ValueError(f"table must be 2-D [num_rows, dim], got shape {tuple(table.shape)}")
    if table.shape[0] == 0 or table.shape[1] == 0:
        raise ValueError(f"table must be non-empty, got shape {tuple(table.shape)}")
    row_bytes = table.shape[1] * table.element_size()
    if row_bytes > layout.MAX_ROW_BYTES:
        raise ValueError(
            f"rows must be at most {layout.MAX_ROW_BYTES} bytes, got {table.shape[1]} x "
            f"{table.dtype} = {row_bytes} bytes"
        )
    if not table.is_contiguous():
        raise ValueError("table must be contiguous (call .contiguous() first)")
    if table.device.type != "cpu":
        raise ValueError(f"tables are compressed on the CPU, got a {table.device} tensor")
    if quant not in (None, "int8_rowwise"):
        raise ValueError(f"quant must be None or 'int8_rowwise', got {quant!r}")
    if quant == "int8_rowwise" and (
        table.dtype != torch.uint8 or table.shape[1] <= INT8_ROWWISE_HEADER_BYTES
    ):
        raise ValueError("quant='int8_rowwise' needs uint8 rows of more than 4 bytes")


def _sample(rows: torch.Tensor, sample_rows: int | None, seed: int) -> torch.Tensor:
    """A uniform random row sample (never a prefix: tables are often sorted by id or frequency)."""
    n = rows.shape[0]
    if sample_rows is None or sample_rows >= n:
        return rows
    gen = torch.Generator().manual_seed(seed)
    if n <= 8 * sample_rows:
        picks = torch.randperm(n, generator=gen)[:sample_rows]
    else:  # randperm(n) would cost 8n bytes; collisions are rare at this ratio and harmless.
        picks = torch.randint(0, n, (sample_rows,), generator=gen).unique()
    return rows.index_select(0, picks.sort().values)


def code_bits_of(mask: torch.Tensor, bitval: torch.Tensor) -> int:
    """C from the codebook length, V * (2^C - 1)."""
    per_position = bitval.numel() // max(mask.numel(), 1)
    if per_position * mask.numel() != bitval.numel() or per_position + 1 not in (2, 4, 8, 16):
        raise ValueError(
            f"bitval holds {bitval.numel()} entries for {mask.numel()} chunk positions: "
            "not V * (2^C - 1) for a C in 1..4"
        )
    return (per_position + 1).bit_length() - 1


def paper_chunk_bits(row_bytes: int) -> int:
    """The paper's chunk: the widest integer view of the row (int64 where it divides)."""
    for bits in CHUNK_BITS_CHOICES:
        if row_bytes % (bits // 8) == 0:
            return bits
    return 16


def _probe(sample: torch.Tensor, seed: int) -> torch.Tensor:
    """At most WIDTH_PROBE_ROWS random rows of the sample: enough to compare sizes."""
    if sample.shape[0] <= WIDTH_PROBE_ROWS:
        return sample
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randperm(sample.shape[0], generator=gen)[:WIDTH_PROBE_ROWS]
    return sample.index_select(0, picks.sort().values)


def _fit_sample(
    sample: torch.Tensor, fit: FitOptions, unit: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(chunk_bits, mask, bitval) for uint8 sample rows [n, row_bytes]; sizes measured in
    slots of ``unit`` bytes. bitval holds the codebooks: V * (2^C - 1) entries."""
    row_bytes = sample.shape[1]
    chunk_bits, code_bits = fit.chunk_bits, fit.code_bits
    if fit.method == "paper":
        bits = chunk_bits or paper_chunk_bits(row_bytes)
        return (bits, *ops.ibp_fit(sample, bits, "paper"))
    if fit.method == "raw":
        # Empty masks: no row can shrink, so every row is stored raw. The uncompressed baseline
        # that runs through the very same engine.
        bits = chunk_bits or paper_chunk_bits(row_bytes)
        v = -(-row_bytes // (bits // 8))
        zeros = torch.zeros(v, dtype=torch.int64)
        return bits, zeros, zeros.clone()
    allowed = [
        [(b, c) for b, c in layouts if chunk_bits in (None, b) and code_bits in (None, c)]
        for layouts in FIT_LAYOUT_CLASSES
    ]
    classes = [layouts for layouts in allowed if layouts]
    if not classes:  # a forced combination outside FIT_LAYOUT_CLASSES (e.g. W = 64 with codebooks)
        classes = [[(chunk_bits or CHUNK_BITS_CHOICES[0], code_bits or 1)]]
    layouts = [layout for layouts in classes for layout in layouts]
    # The layout is chosen on a sub-sample (the fits are the costly part), then the masks of the
    # chosen layout are fitted on the whole sample.
    probe = sample if len(layouts) == 1 else _probe(sample, fit.seed)
    fits: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fit_on_probe(bits: int, code: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (bits, code) not in fits:
            if code == 1:
                fits[bits, 1] = ops.ibp_fit(probe, bits, "ibpembed")
            else:  # every code width of this chunk width in one call: they share most work
                codes = [c for b, c in layouts if b == bits and c > 1]
                out = ops.ibp_fit_codebooks(probe, bits, codes)
                fits.update({(bits, c): (out[2 * i], out[2 * i + 1]) for i, c in enumerate(codes)})
        return fits[bits, code]

    def probe_bytes(bits: int, code: int) -> int:
        mask, bitval = fit_on_probe(bits, code)
        size = int(ops.ibp_slot_bytes(probe, bits, mask, bitval, unit).sum())
        return size + 8 * (mask.numel() + bitval.numel())  # as CompressedTable counts them

    slack = FASTER_LAYOUT_SLACK * probe.numel()
    best: tuple[int, int, int] | None = None  # (bytes, bits, code)
    for layouts in classes:
        size, bits, code = min((probe_bytes(b, c), b, c) for b, c in layouts)
        if best is None or size < best[0] - slack:
            best = (size, bits, code)
    assert best is not None
    _, bits, code = best
    mask, bitval = fit_on_probe(bits, code)
    if probe is not sample:
        mask, bitval = ops.ibp_fit(sample, bits, "ibpembed", code)
    return bits, mask, bitval


@dataclass(frozen=True)
class FitOptions:
    """How ``compress`` fits a table: one value for every writer that compresses
    (``compress``, ``tables.writer.pack_table``, ``tables.pack.pack_table_set``), so the
    options and their checks live in one place. Invalid values raise ValueError on creation.

    Fields
    ------
    method : ``"ibpembed"`` (per-position masks, chunk width and code width chosen by measured
        size: plain IBP or exponent-aware codebooks, format.h) or
        ``"paper"`` (the published global-threshold sweep on the widest integer view), or
        ``"raw"`` (every row stored raw: the uncompressed baseline in the same layout and engine).
    sample_rows : rows sampled uniformly at random (``seed``) to fit the masks; None = all rows.
    seed : seeds the row sample and the layout probe.
    align : slot alignment in bytes (a power of two; raised for very wide rows). None: the
        unit that stores the sample smallest among those that leave raw rows unpadded.
    chunk_bits : force the chunk width (16, 32 or 64) instead of choosing it.
    code_bits : force the code width C (1 = the published one-pattern IBP, fastest to decode;
        2..4 = codebooks of 2^C - 1 patterns per position) instead of choosing it. ``"paper"``
        and ``"raw"`` have no codebooks: 1 or None only.
    quant : ``"int8_rowwise"`` for uint8 rows in fbgemm's row-wise int8 layout (checked against
        the table by ``validate_table``).
    """

    method: Method = "ibpembed"
    sample_rows: int | None = DEFAULT_SAMPLE_ROWS
    seed: int = 0
    align: int | None = DEFAULT_ALIGN
    chunk_bits: int | None = None
    code_bits: int | None = None
    quant: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ibpembed", "paper", "raw"):
            raise ValueError(f"method must be 'ibpembed', 'paper' or 'raw', got {self.method!r}")
        if self.sample_rows is not None and self.sample_rows <= 0:
            raise ValueError(f"sample_rows must be positive, got {self.sample_rows}")
        align = self.align
        if align is not None and (align <= 0 or align & (align - 1) or align > MAX_SLOT_UNIT):
            raise ValueError(f"align must be a power of two <= {MAX_SLOT_UNIT}, got {align}")
        if self.chunk_bits is not None and self.chunk_bits not in CHUNK_BITS_CHOICES:
            raise ValueError(
                f"chunk_bits must be one of {CHUNK_BITS_CHOICES}, got {self.chunk_bits}"
            )
        if self.code_bits is not None and self.code_bits not in CODE_BITS_CHOICES:
            raise ValueError(f"code_bits must be one of {CODE_BITS_CHOICES}, got {self.code_bits}")
        if self.method in ("paper", "raw") and self.code_bits not in (None, 1):
            raise ValueError(
                f"method {self.method!r} has no codebooks: code_bits must be None or 1"
            )

    def meta(self) -> dict[str, Any]:
        """The fit parameters a table file's meta section records (``docs/format.md``); the
        forced layout is in the header, and ``quant`` is recorded with the name."""
        return {
            "method": self.method,
            "align": self.align,
            "sample_rows": self.sample_rows,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class TableFit:
    """What ``compress`` decides before it writes a byte: chunk width, masks and slot unit."""

    chunk_bits: int
    mask: torch.Tensor  # int64 [V]
    bitval: torch.Tensor  # int64 [V * (2^C - 1)], the codebooks
    unit_bytes: int

    @property
    def code_bits(self) -> int:
        return code_bits_of(self.mask, self.bitval)


def fit_table(table: torch.Tensor, fit: FitOptions | None = None) -> TableFit:
    """The fit ``compress`` runs (same options, same sample): for writers that stream rows."""
    fit = fit or FitOptions()
    validate_table(table, fit.quant)
    rows = table.view(torch.uint8).view(table.shape[0], -1)
    sample = _sample(rows, fit.sample_rows, fit.seed)
    units = slot_unit_candidates(rows.shape[1], fit.align)
    bits, mask, bitval = _fit_sample(sample, fit, units[0])
    unit = units[0]
    if len(units) > 1:
        probe = _probe(sample, fit.seed)
        finest = ops.ibp_slot_bytes(probe, bits, mask, bitval, units[0])
        # One sizing serves every candidate: each divides the row width and is a multiple of the
        # finest u0, so a slot of ceil(b / u0) * u0 bytes takes ceil(b / u) * u at unit u (raw
        # rows stay raw, whole rows).
        sizes = [int((-(-finest // u) * u).sum()) for u in units]
        # Coarser units align rows better for wide loads: keep the coarsest of the smallest.
        unit = max(u for u, size in zip(units, sizes, strict=True) if size == min(sizes))
    return TableFit(bits, mask, bitval, unit)


def compress(
    table: torch.Tensor, *, fit: FitOptions | None = None, **options: Any
) -> CompressedTable:
    """Compress a [num_rows, dim] CPU table losslessly.

    >>> compress(weights, chunk_bits=32)                    # options as keywords, or
    >>> compress(weights, fit=FitOptions(chunk_bits=32))   # as one value to pass along

    Parameters
    ----------
    table : contiguous 2-D fp32 / fp16 / bf16 / int8 / uint8 tensor.
    fit : how to fit it (:class:`FitOptions`; default: its defaults).
    options : :class:`FitOptions` fields (``method``, ``sample_rows``, ``seed``, ``align``,
        ``chunk_bits``, ``code_bits``, ``quant``), replacing those of ``fit``.
    """
    fit = dataclasses.replace(fit or FitOptions(), **options)
    fitted = fit_table(table, fit)
    rows = table.view(torch.uint8).view(table.shape[0], -1)
    payload, block_base, row_units, bitmask = ops.ibp_compress(
        rows, fitted.chunk_bits, fitted.mask, fitted.bitval, fitted.unit_bytes
    )
    return CompressedTable(
        payload=payload,
        block_base=block_base,
        row_units=row_units,
        bitmask=bitmask,
        mask=fitted.mask,
        bitval=fitted.bitval,
        chunk_bits=fitted.chunk_bits,
        num_rows=table.shape[0],
        dim=table.shape[1],
        dtype=table.dtype,
        unit_bytes=fitted.unit_bytes,
        quant=fit.quant,
    )
