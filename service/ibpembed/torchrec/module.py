# SPDX-License-Identifier: Apache-2.0
"""A drop-in, losslessly compressed replacement for torchrec's ``EmbeddingBagCollection``.

``CompressedEmbeddingBagCollection`` answers ``forward(KeyedJaggedTensor) -> KeyedTensor`` exactly
like the ``EmbeddingBagCollection`` it was built from (same keys, order, dims and pooling per
table), but keeps every table IBP-compressed in host memory and pools through
``torch.ops.ibpembed.lookup_pooled``. Inference only: there are no gradients and no optimizer state.

This file is written in the TorchScript subset (PEP 604 unions, builtin generics and f-strings all
script) because torchrec users ship inference models with ``torch.jit.script``.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ibpembed import _C
from ibpembed._ops import DTYPE_CODES, ops
from ibpembed.codec import CompressedTable, HotRows, compress
from ibpembed.hot_rows import DEFAULT_BUDGET as DEFAULT_HOT_ROW_BUDGET
from ibpembed.hot_rows import hot_row_ids
from ibpembed.tables.format import TableFileError, check_index
from ibpembed.tables.manifest import load_table_set

# Bumped whenever the meaning of the buffers changes, so an old state_dict is rejected with a
# clear error instead of decoding garbage.
STATE_VERSION = 1

_POOLING_CODES: dict[PoolingType, int] = {PoolingType.SUM: 0, PoolingType.MEAN: 1}
_TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}
_DATA_TYPES = {str(dtype).removeprefix("torch."): d for d, dtype in _TORCH_DTYPES.items()}
_BUFFER_NAMES = ("payload", "block_base", "row_units", "bitmask", "mask", "bitval", "meta")
# The dtype of each table buffer (format.h; the order of CompressedTable's tensors).
_BUFFER_DTYPES = (torch.uint8, torch.int64, torch.uint8, torch.int32, torch.int64, torch.int64)
# Buffers that stay in host memory when the module moves to a GPU (see _apply).
_HOST_BUFFERS = ("payload", "hot_ids", "hot_dir", "hot_rows")
# The compact row layout the payload is in (format.h); a payload in another layout must be repacked.
LAYOUT_VERSION = int(_C.FORMAT_VERSION)
# Layout 2 is layout 3 with one-pattern codebooks: its state dicts load unchanged.
READABLE_LAYOUTS = (2, LAYOUT_VERSION)
# meta = [STATE_VERSION, LAYOUT_VERSION, chunk_bits, unit_bytes, num_rows, dim, dtype code]
_META_FIELDS = 7


class CompressedEmbeddingBag(nn.Module):
    """One compressed table with the pooling of an ``nn.EmbeddingBag`` (sum or mean).

    The compressed tensors are persistent buffers (``payload``, ``block_base``, ``row_units``,
    ``bitmask``, ``mask``, ``bitval``) plus a small int64 ``meta`` buffer holding the integers the
    decoder needs, so ``state_dict`` carries the whole table. Because the payload size depends on
    the table's contents, ``load_state_dict`` replaces the buffers instead of copying into them
    (like ``load_state_dict(assign=True)``): the module then shares memory with the state dict,
    which keeps ``torch.load(..., mmap=True)`` tables paged out until rows are read.

    Parameters
    ----------
    num_embeddings, embedding_dim : table shape.
    dtype : row dtype of the source table (float32, float16 or bfloat16).
    pooling : ``PoolingType.SUM`` or ``PoolingType.MEAN``.
    table : the compressed table; None builds an empty placeholder to ``load_state_dict`` into.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        pooling: PoolingType = PoolingType.SUM,
        table: CompressedTable | None = None,
    ) -> None:
        super().__init__()
        if pooling not in _POOLING_CODES:
            raise ValueError(f"pooling must be SUM or MEAN, got {pooling}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"pooled tables must be float32, float16 or bfloat16, got {dtype}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.pooling_code = _POOLING_CODES[pooling]
        self.dtype_code = DTYPE_CODES[dtype]
        self.row_bytes = embedding_dim * dtype.itemsize
        self.chunk_bits = 0
        self.unit_bytes = 0
        # Hot-row copies (CompressedTable.with_hot_rows): a cache, so not in the state dict.
        # Empty when off; set with set_hot_rows.
        self.register_buffer("hot_ids", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("hot_dir", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("hot_rows", torch.empty(0, 0, dtype=torch.uint8), persistent=False)
        if table is None:
            for name in _BUFFER_NAMES:
                self.register_buffer(name, torch.empty(0, dtype=torch.int64))
            return
        if (table.num_rows, table.dim, table.dtype) != (num_embeddings, embedding_dim, dtype):
            raise ValueError(
                f"compressed table is {table.num_rows}x{table.dim} {table.dtype}, expected "
                f"{num_embeddings}x{embedding_dim} {dtype}"
            )
        for name in _BUFFER_NAMES[:-1]:
            self.register_buffer(name, getattr(table, name))
        meta = [STATE_VERSION, LAYOUT_VERSION, table.chunk_bits, table.unit_bytes, table.num_rows,
                table.dim]  # fmt: skip
        self.register_buffer("meta", torch.tensor([*meta, self.dtype_code], dtype=torch.int64))
        self.chunk_bits = table.chunk_bits
        self.unit_bytes = table.unit_bytes
        self._set_hot(table.hot)

    def forward(
        self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        """Pooled rows: [B, D] float32 for int64 ``indices`` [nnz] and ``offsets`` [B + 1].

        The op itself rejects out-of-range ids and malformed offsets; the collection checks them
        earlier so that no kernel runs for a bad batch.
        """
        if self.chunk_bits == 0:
            raise RuntimeError(
                "CompressedEmbeddingBag has no table: build it with a CompressedTable or "
                "load_state_dict into it"
            )
        hot_dir: Tensor | None = None
        hot_rows: Tensor | None = None
        if self.hot_ids.numel() > 0:
            hot_dir, hot_rows = self.hot_dir, self.hot_rows
        return ops.lookup_pooled(
            self.payload,
            self.block_base,
            self.row_units,
            self.bitmask,
            self.mask,
            self.bitval,
            self.chunk_bits,
            self.row_bytes,
            self.unit_bytes,
            self.num_embeddings,
            indices,
            offsets,
            per_sample_weights,
            self.dtype_code,
            self.pooling_code,
            hot_dir,
            hot_rows,
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        """Moves like any module, except that on a GPU the rows stay in host memory.

        The CUDA kernels read compressed rows zero-copy over PCIe from page-locked host memory
        and need only the index, bitmask and masks on the device, so ``.cuda()`` / ``.to(gpu)``
        pins the payload (a copy into page-locked memory, unless it is pinned already) instead
        of copying the table into GPU memory. Hot-row copies, a CPU-lookup cache the CUDA
        kernels do not read, stay on the host as well. Move the module before scripting it: a
        scripted module's ``.to()`` (and loading tensors that are already on a GPU) moves every
        buffer, the payload into GPU memory.
        """
        probe = torch.empty(0, dtype=torch.int64, device=self.block_base.device)
        # Only real host rows stay behind: a payload already on a device, or a meta placeholder
        # (to_empty), moves like any buffer.
        if fn(probe).device.type != "cuda" or self.payload.device.type != "cpu":
            return super()._apply(fn, recurse)
        host = {name: self._buffers.pop(name) for name in _HOST_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(host)
        if not self._buffers["payload"].is_pinned():
            self._buffers["payload"] = self._buffers["payload"].pin_memory()
        return self

    @torch.jit.unused
    def set_hot_rows(self, ids: Tensor) -> int:
        """Keep decoded copies of rows ``ids`` for CPU lookups (replacing earlier ones; empty
        ``ids`` drops them); see ``CompressedTable.with_hot_rows``. Returns the rows cached.

        CPU modules only: the CUDA kernels decode every row on the GPU and ignore copies.
        """
        if self.block_base.device.type != "cpu":
            raise RuntimeError(
                "hot-row copies serve CPU lookups; this table's index is on "
                f"{self.block_base.device}"
            )
        hot = self.compressed_table().with_hot_rows(ids).hot
        self._set_hot(hot)
        return 0 if hot is None else hot.count

    def _set_hot(self, hot: HotRows | None) -> None:
        if hot is None:
            self.hot_ids = torch.empty(0, dtype=torch.int64)
            self.hot_dir = torch.empty(0, dtype=torch.int64)
            self.hot_rows = torch.empty(0, 0, dtype=torch.uint8)
        else:
            self.hot_ids, self.hot_dir, self.hot_rows = hot.ids, hot.directory, hot.rows

    def compressed_table(self) -> CompressedTable:
        """The buffers as a ``CompressedTable`` (for ``gather``, ``decompress`` and sizes)."""
        if self.chunk_bits == 0:
            raise RuntimeError("CompressedEmbeddingBag has no table yet")
        hot = None
        if self.hot_ids.numel() > 0:
            hot = HotRows(self.hot_ids, self.hot_dir, self.hot_rows)
        return CompressedTable(
            payload=self.payload,
            block_base=self.block_base,
            row_units=self.row_units,
            bitmask=self.bitmask,
            mask=self.mask,
            bitval=self.bitval,
            chunk_bits=self.chunk_bits,
            num_rows=self.num_embeddings,
            dim=self.embedding_dim,
            dtype=self.dtype,
            unit_bytes=self.unit_bytes,
            hot=hot,
        )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Tensor],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # NOTE: nn.Module's loader copies into same-shaped buffers; a compressed payload's size
        # depends on the table's contents, so the buffers are replaced instead.
        present = {
            name: state_dict[prefix + name] for name in _BUFFER_NAMES if prefix + name in state_dict
        }
        missing_keys.extend(prefix + name for name in _BUFFER_NAMES if name not in present)
        if strict:
            unexpected_keys.extend(
                key
                for key in state_dict
                if key.startswith(prefix)
                and "." not in key[len(prefix) :]
                and key[len(prefix) :] not in _BUFFER_NAMES
            )
        if len(present) != len(_BUFFER_NAMES):
            return
        meta = present["meta"]
        if meta.dtype != torch.int64 or meta.numel() != _META_FIELDS:
            error_msgs.append(f"{prefix}meta: expected {_META_FIELDS} int64 values")
            return
        version, layout, chunk_bits, unit_bytes, num_rows, dim, dtype_code = meta.tolist()
        if version != STATE_VERSION:
            error_msgs.append(
                f"{prefix}meta: state version {version} is not supported (this build reads "
                f"version {STATE_VERSION})"
            )
            return
        if layout not in READABLE_LAYOUTS:
            error_msgs.append(
                f"{prefix}meta: rows are in compact layout version {layout}, this build decodes "
                f"versions {READABLE_LAYOUTS}; compress the table again"
            )
            return
        expected = (self.num_embeddings, self.embedding_dim, self.dtype_code)
        if (num_rows, dim, dtype_code) != expected:
            error_msgs.append(
                f"{prefix}: state holds a {num_rows}x{dim} table of dtype code {dtype_code}, "
                f"this module expects {expected[0]}x{expected[1]} of dtype code {expected[2]}"
            )
            return
        problem = _table_problem(present, chunk_bits, unit_bytes, num_rows, dim, self.dtype)
        if problem is not None:
            error_msgs.append(f"{prefix}{problem}")
            return
        for name, tensor in present.items():
            self._buffers[name] = tensor.detach()
        self.chunk_bits = chunk_bits
        self.unit_bytes = unit_bytes
        self._set_hot(None)  # copies of the previous rows

    def extra_repr(self) -> str:
        pooling = "sum" if self.pooling_code == 0 else "mean"
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, mode={pooling}"


# The first word of the op's table checks (table_view in lookup_ops.cpp) names the buffer at
# fault, or one of these ints, which come from meta (row_bytes through its dim and dtype).
_META_INTS = ("chunk_bits", "unit_bytes", "row_bytes", "num_rows")


def _table_problem(
    buffers: dict[str, Tensor],
    chunk_bits: int,
    unit_bytes: int,
    num_rows: int,
    dim: int,
    dtype: torch.dtype,
) -> str | None:
    """Why ``buffers`` (a state dict's, meta's ints) do not form a table the decoder can read,
    starting with the name of the buffer at fault; None when they do.

    The checks are the codec's: the op's own (dtypes, shapes, masks and codebooks, the index
    against the payload) on the candidate tensors, then the loader's structural checks of the
    index (``ibpembed.tables.format``), so a bad state dict fails here, not at the first forward.
    """
    for name, expected in zip(_BUFFER_NAMES[:-1], _BUFFER_DTYPES, strict=True):
        tensor = buffers[name]
        if tensor.dtype != expected or tensor.dim() != 1:
            shape = list(tensor.shape)
            return f"{name}: expected a 1-D {expected} tensor, got {tensor.dtype} of shape {shape}"
    if chunk_bits not in (16, 32, 64):
        return f"meta: chunk_bits must be 16, 32 or 64, got {chunk_bits}"
    # The checks run on the host (the tensors of a GPU module's state dict are copied there,
    # except the payload: only its size is checked, and a host payload is not read).
    host = {name: buffers[name].cpu() for name in _BUFFER_NAMES[1:-1]}
    payload = buffers["payload"]
    if payload.device.type != "cpu":
        if not payload.is_contiguous():
            return "payload: must be contiguous"
        payload = torch.empty(payload.numel(), dtype=torch.uint8)
    table = CompressedTable(
        payload=payload, chunk_bits=chunk_bits, num_rows=num_rows, dim=dim, dtype=dtype,
        unit_bytes=unit_bytes, **host,
    )  # fmt: skip
    try:
        table.gather(torch.empty(0, dtype=torch.int64))  # checks the table, reads no row
        if num_rows > 0:
            check_index(Path("state dict"), table)
    except TableFileError as exc:
        return f"{exc.section}: {exc.problem}"
    except (ValueError, RuntimeError) as exc:
        message = str(exc).splitlines()[0]  # e.g. "row_units must have 1024 entries, got 128"
        culprit = message.split(" ", 1)[0].split("[", 1)[0]
        return f"meta: {message}" if culprit in _META_INTS else message
    return None


@dataclass(frozen=True)
class TableBytes:
    """Host bytes of one table before and after compression.

    Attributes
    ----------
    module : dotted path of the collection inside the model ("" for the model itself).
    table : table name in the collection.
    num_embeddings, embedding_dim : table shape.
    raw_bytes : bytes of the dense torchrec weight.
    stored_bytes : bytes of everything needed to decode (payload, index, bitmask, masks).
    hot_bytes : bytes of hot-row copies (``cache_hot_rows``), on top of ``stored_bytes``.
    """

    module: str
    table: str
    num_embeddings: int
    embedding_dim: int
    raw_bytes: int
    stored_bytes: int
    hot_bytes: int = 0

    @property
    def savings(self) -> float:
        """1 - stored / raw."""
        return 1.0 - self.stored_bytes / self.raw_bytes


class CompressedEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """torchrec ``EmbeddingBagCollection`` for inference, with IBP-compressed host tables.

    Build it with :meth:`from_ebc`, :meth:`from_table_set`, or from configs and ``load_state_dict``.
    ``forward`` returns the ``KeyedTensor`` torchrec's module would: keys in table order (a feature
    shared by several tables is named ``feature@table``), ``length_per_key`` the table dims, fp32
    values pooled with each table's SUM or MEAN. Weighted collections (``is_weighted=True``)
    multiply each row by the KJT's weight; as in torchrec, weights are ignored otherwise.

    Every batch is checked before any kernel runs; the errors are:

    - ``KeyError`` for a KJT key no table reads (torchrec silently ignores these; pass
      ``allow_unknown_keys=True`` to do the same) or a feature missing from the KJT;
    - ``IndexError`` naming the feature, table, id and table size for an out-of-range id;
    - ``ValueError`` for lengths that are negative or do not match the values or the batch size,
      for weights missing or of the wrong size, and ``TypeError`` for non-integer ids;
    - ``NotImplementedError`` for variable-batch (VBE) KJTs.

    Under ``torch.jit.script`` the same checks raise ``torch.jit.Error`` whose message ends with the
    Python exception name and text.

    Parameters
    ----------
    tables : one ``EmbeddingBagConfig`` per table (pooling SUM or MEAN; data type FP32, FP16 or
        BF16).
    is_weighted : whether the KJT carries per-id weights that scale the rows.
    compressed : compressed table per table name; None builds empty tables for ``load_state_dict``.
    allow_unknown_keys : ignore KJT keys that no table reads instead of raising.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        compressed: dict[str, CompressedTable] | None = None,
        allow_unknown_keys: bool = False,
    ) -> None:
        super().__init__()
        self._is_weighted = is_weighted
        self._allow_unknown_keys = allow_unknown_keys
        self._embedding_bag_configs = [_checked_config(c) for c in tables]
        self.embedding_bags = nn.ModuleDict()
        if len({c.name for c in tables}) != len(tables):
            raise ValueError("table names must be unique")
        for config in self._embedding_bag_configs:
            table = None if compressed is None else compressed[config.name]
            self.embedding_bags[config.name] = CompressedEmbeddingBag(
                config.num_embeddings,
                config.embedding_dim,
                _TORCH_DTYPES[config.data_type],
                config.pooling,
                table,
            )
        configs = self._embedding_bag_configs
        self._feature_names: list[list[str]] = [list(c.feature_names) for c in configs]
        self._embedding_names: list[str] = [
            name for names in get_embedding_names_by_table(configs) for name in names
        ]
        self._lengths_per_embedding: list[int] = [
            c.embedding_dim for c in configs for _ in c.feature_names
        ]
        self._table_names: list[str] = [c.name for c in configs]
        self._num_embeddings: list[int] = [c.num_embeddings for c in configs]
        self._known_features: dict[str, int] = {
            f: i for i, names in enumerate(self._feature_names) for f in names
        }
        # Ids a feature may hold: the rows of the smallest table reading it.
        self._feature_rows: dict[str, int] = {}
        for i, names in enumerate(self._feature_names):
            for f in names:
                rows = self._num_embeddings[i]
                self._feature_rows[f] = min(self._feature_rows.get(f, rows), rows)

    @classmethod
    def from_ebc(
        cls, ebc: EmbeddingBagCollection, allow_unknown_keys: bool = False, **compress_kwargs: Any
    ) -> "CompressedEmbeddingBagCollection":
        """Compress every table of a float torchrec ``EmbeddingBagCollection``.

        Parameters
        ----------
        ebc : the module to replace; its weights are read, never modified.
        allow_unknown_keys : see the class docstring.
        **compress_kwargs : passed to :func:`ibpembed.compress` (``method``, ``align``, ...).
        """
        if not isinstance(ebc, EmbeddingBagCollection):
            raise TypeError(f"expected a torchrec EmbeddingBagCollection, got {type(ebc).__name__}")
        compressed = {}
        for config in ebc.embedding_bag_configs():
            weight = ebc.embedding_bags[config.name].weight.detach()
            if weight.device.type == "meta":
                raise ValueError(f"table {config.name!r} is on the meta device: no weights")
            compressed[config.name] = compress(weight.cpu().contiguous(), **compress_kwargs)
        return cls(
            ebc.embedding_bag_configs(),
            ebc.is_weighted(),
            compressed,
            allow_unknown_keys=allow_unknown_keys,
        )

    @classmethod
    def from_table_set(
        cls,
        directory: str | os.PathLike[str],
        tables: list[str] | None = None,
        is_weighted: bool = False,
        allow_unknown_keys: bool = False,
        verify: bool = False,
    ) -> "CompressedEmbeddingBagCollection":
        """Load a packed table set (``ibpembed pack``, ``ibpembed.tables``) as a collection.

        Tables keep the feature names and pooling their manifest records (tables packed without
        a pooling pool with SUM, torchrec's default). The payloads stay memory-mapped from the
        table files until rows are read.

        Parameters
        ----------
        directory : the table set (its ``manifest.json`` and ``.ibpt`` files).
        tables : table names in the order the output ``KeyedTensor`` should list them (pass
            ``[c.name for c in ebc.embedding_bag_configs()]`` to match a model); default: every
            table in manifest order.
        is_weighted, allow_unknown_keys : see the class docstring.
        verify : hash every payload while loading (see ``ibpembed.tables.load_table_set``).

        Raises
        ------
        KeyError
            for a name in ``tables`` the set does not hold.
        ValueError
            for tables torchrec cannot pool as floats (row-wise int8, int8/uint8 rows).
        """
        manifest, compressed = load_table_set(directory, verify=verify)
        names = list(manifest.tables) if tables is None else tables
        configs = []
        for name in names:
            if name not in manifest.tables:
                raise KeyError(f"table '{name}' is not in the table set {directory}")
            entry = manifest.tables[name]
            if entry.quant is not None or entry.dtype not in _DATA_TYPES:
                raise ValueError(
                    f"table '{name}' holds {entry.dtype} rows (quant={entry.quant}): only "
                    f"float32, float16 and bfloat16 tables can back an EmbeddingBagCollection"
                )
            configs.append(
                EmbeddingBagConfig(
                    name=name,
                    embedding_dim=entry.dim,
                    num_embeddings=entry.num_rows,
                    feature_names=list(entry.feature_names),
                    pooling=PoolingType.MEAN if entry.pooling == "mean" else PoolingType.SUM,
                    data_type=_DATA_TYPES[entry.dtype],
                )
            )
        return cls(configs, is_weighted, {n: compressed[n] for n in names}, allow_unknown_keys)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: when a table's buffers are missing or
        do not form a valid table (the error names the buffer), no table changes."""
        saved = [
            (bag, dict(bag._buffers), bag.chunk_bits, bag.unit_bytes)
            for bag in self.embedding_bags.values()
        ]
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except Exception:
            for bag, buffers, chunk_bits, unit_bytes in saved:
                bag._buffers.clear()
                bag._buffers.update(buffers)
                bag.chunk_bits, bag.unit_bytes = chunk_bits, unit_bytes
            raise

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as torchrec's ``EmbeddingBagCollection.embedding_bag_configs()``."""
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        """Whether the KJT's weights scale the rows."""
        return self._is_weighted

    @torch.jit.unused
    def table_bytes(self, module: str = "") -> list[TableBytes]:
        """Host bytes per table: dense torchrec weight vs everything the compressed table keeps."""
        report = []
        for name in self._table_names:
            t = self.embedding_bags[name].compressed_table()
            report.append(
                TableBytes(
                    module, name, t.num_rows, t.dim, t.raw_bytes, t.stored_bytes, t.hot_bytes
                )
            )
        return report

    @torch.jit.unused
    def cache_hot_rows(
        self, batches: list[KeyedJaggedTensor], budget: float = DEFAULT_HOT_ROW_BUDGET
    ) -> dict[str, int]:
        """Keep decoded copies of each table's most frequent rows in ``batches`` (a sample of
        real traffic), within ``budget`` x the table's raw bytes, the server's policy
        (``ibpembed.hot_rows``). CPU forwards then read those rows instead of decoding them;
        outputs do not change. Call it again to re-rank; ``budget=0`` drops the copies.

        Returns the rows cached per table.
        """
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"budget must be in [0, 1], got {budget}")
        seen: dict[str, list[Tensor]] = {name: [] for name in self._table_names}
        for kjt in batches:
            per_feature = kjt.to_dict()
            for i, names in enumerate(self._feature_names):
                for feature in names:
                    if feature in per_feature:
                        ids = per_feature[feature].values().to(torch.int64)
                        seen[self._table_names[i]].append(ids)
        cached: dict[str, int] = {}
        for name, chunks in seen.items():
            bag = self.embedding_bags[name]
            ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
            table = bag.compressed_table()
            chosen = hot_row_ids(table, ids, budget) if budget > 0 else ids[:0]
            cached[name] = bag.set_hot_rows(chosen)
        return cached

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature with its table; see the class docstring for the checks.

        Parameters
        ----------
        features : KJT with keys F, int32/int64 values [nnz], lengths [F * B] and, for a weighted
            collection, weights [nnz].

        Returns
        -------
        KeyedTensor with values [B, sum of dims] float32, keys as torchrec's module would give.
        """
        offsets_per_key = self._validate(features)
        values = features.values().to(torch.int64).contiguous()
        weights = features.weights_or_none() if self._is_weighted else None
        if weights is not None:
            weights = weights.to(torch.float32).contiguous()
        keys = features.keys()
        stride = features.stride()
        # Every key's bag offsets at once ([keys, B + 1], one row per key): the per-feature tensor
        # ops of a batch cost more than its lookups on small tables.
        lengths = features.lengths().to(torch.int64).reshape(len(keys), stride)
        bag_offsets = torch.cat([lengths.new_zeros(len(keys), 1), lengths.cumsum(1)], dim=1)
        key_index: dict[str, int] = {k: i for i, k in enumerate(keys)}
        pooled: list[Tensor] = []
        for i, bag in enumerate(self.embedding_bags.values()):
            for feature in self._feature_names[i]:
                k = key_index[feature]
                start, end = offsets_per_key[k], offsets_per_key[k + 1]
                bag_weights: Tensor | None = None
                if weights is not None:
                    bag_weights = weights[start:end]
                pooled.append(bag(values[start:end], bag_offsets[k], bag_weights))
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=torch.cat(pooled, dim=1),
        )

    def _validate(self, features: KeyedJaggedTensor) -> list[int]:
        """Check the whole batch before any lookup; returns the per-key value offsets [F + 1]."""
        keys = features.keys()
        if not self._allow_unknown_keys:
            for key in keys:
                if key not in self._known_features:
                    known = sorted(self._known_features.keys())
                    raise KeyError(f"KJT key '{key}' is not read by any table; known: {known}")
        present: dict[str, int] = {k: i for i, k in enumerate(keys)}
        for feature in self._known_features:
            if feature not in present:
                raise KeyError(f"feature '{feature}' is missing from the KJT (keys: {keys})")
        if features.variable_stride_per_key():
            raise NotImplementedError("variable-batch (VBE) KeyedJaggedTensors are not supported")
        values = features.values()
        lengths = features.lengths()
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"KJT values must be integer ids, got {values.dtype}")
        stride = features.stride()
        if lengths.dim() != 1 or lengths.numel() != len(keys) * stride:
            raise ValueError(
                f"KJT lengths has {lengths.numel()} entries, expected {len(keys)} keys x "
                f"batch {stride} = {len(keys) * stride}"
            )
        if lengths.numel() > 0 and int(lengths.min()) < 0:
            raise ValueError(f"KJT lengths must be non-negative, got {int(lengths.min())}")
        total = int(lengths.sum()) if lengths.numel() > 0 else 0
        if total != values.numel():
            raise ValueError(f"KJT lengths sum to {total} but there are {values.numel()} values")
        if self._is_weighted:
            weights = features.weights_or_none()
            if weights is None:
                raise ValueError("this collection is weighted: the KJT must carry weights")
            if weights.numel() != values.numel():
                raise ValueError(f"KJT has {weights.numel()} weights for {values.numel()} values")
        per_key: list[int] = [0] * len(keys)
        if stride > 0:
            per_key = torch.jit.annotate(list[int], lengths.view(len(keys), stride).sum(1).tolist())
        offsets: list[int] = [0]
        for n in per_key:
            offsets.append(offsets[-1] + n)
        if values.numel() == 0:
            return offsets
        # One pass over all ids against each key's limit; the loop below only names the culprit.
        # Keys no table reads (allow_unknown_keys) get int64's max: never out of range.
        limits = [self._feature_rows.get(key, 9223372036854775807) for key in keys]
        per_id_limit = torch.repeat_interleave(
            torch.tensor(limits, dtype=torch.int64, device=values.device),
            torch.tensor(per_key, dtype=torch.int64, device=values.device),
        )
        if not bool(((values < 0) | (values >= per_id_limit)).any()):
            return offsets
        for i, names in enumerate(self._feature_names):
            num_rows = self._num_embeddings[i]
            for feature in names:
                k = present[feature]
                ids = values[offsets[k] : offsets[k + 1]]
                if ids.numel() == 0:
                    continue
                bad = (ids < 0) | (ids >= num_rows)
                if bool(bad.any()):
                    pos = int(torch.nonzero(bad)[0, 0])
                    raise IndexError(
                        f"feature '{feature}' (table '{self._table_names[i]}'): id "
                        f"{int(ids[pos])} at position {pos} is out of range for a table of "
                        f"{num_rows} rows"
                    )
        return offsets


def _checked_config(config: EmbeddingBagConfig) -> EmbeddingBagConfig:
    """A copy of ``config`` (the module must not share mutable configs with the source model)."""
    if config.pooling not in _POOLING_CODES:
        raise ValueError(
            f"table {config.name!r}: pooling must be SUM or MEAN, got {config.pooling}"
        )
    if config.data_type not in _TORCH_DTYPES:
        raise ValueError(
            f"table {config.name!r}: data_type must be FP32, FP16 or BF16, got {config.data_type}"
        )
    feature_names = list(config.feature_names) or [config.name]
    return replace(config, feature_names=feature_names)


def compress_model(
    model: nn.Module, allow_unknown_keys: bool = False, **compress_kwargs: Any
) -> list[TableBytes]:
    """Replace every torchrec ``EmbeddingBagCollection`` inside ``model``, in place.

    Parameters
    ----------
    model : any module holding float ``EmbeddingBagCollection`` submodules (quantized and sharded
        collections are different classes and are left alone).
    allow_unknown_keys : passed to each new collection; set it when one KJT carrying features
        for several collections is fed to each of them.
    **compress_kwargs : passed to :func:`ibpembed.compress`.

    Returns
    -------
    Host bytes per table before and after, in module order (see :func:`format_table_bytes`); a
    collection registered under several paths is replaced at each by one compressed module and
    reported once, under its first path.

    Raises
    ------
    TypeError
        If ``model`` is itself an ``EmbeddingBagCollection`` (there is no parent to swap it in:
        use ``CompressedEmbeddingBagCollection.from_ebc``).
    ValueError
        If ``model`` holds no ``EmbeddingBagCollection``.
    """
    if isinstance(model, EmbeddingBagCollection):
        raise TypeError(
            "model is itself an EmbeddingBagCollection: use "
            "CompressedEmbeddingBagCollection.from_ebc(model)"
        )
    # Collected first: swapping while named_modules() walks the tree would skip siblings. Every
    # path: a collection registered under several (shared) is replaced at each, by one module.
    targets = [
        (path, m)
        for path, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, EmbeddingBagCollection)
    ]
    if not targets:
        raise ValueError(f"{type(model).__name__} holds no torchrec EmbeddingBagCollection")
    report: list[TableBytes] = []
    done: dict[int, CompressedEmbeddingBagCollection] = {}
    for path, ebc in targets:
        compressed = done.get(id(ebc))
        if compressed is None:
            compressed = CompressedEmbeddingBagCollection.from_ebc(
                ebc, allow_unknown_keys=allow_unknown_keys, **compress_kwargs
            )
            done[id(ebc)] = compressed
            report.extend(compressed.table_bytes(path))  # once: its tables are stored once
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, compressed)
    return report


def format_table_bytes(report: list[TableBytes]) -> str:
    """A plain-text table of :func:`compress_model`'s report, with a total line."""
    names = [f"{r.module}.{r.table}" if r.module else r.table for r in report]
    w = max([len("module.table"), *map(len, names)])
    lines = [
        f"{'module.table':<{w}} {'rows x dim':>12} {'raw bytes':>13} {'stored':>13} {'saved':>7}"
    ]
    for name, r in zip(names, report, strict=True):
        shape = f"{r.num_embeddings}x{r.embedding_dim}"
        lines.append(
            f"{name:<{w}} {shape:>12} {r.raw_bytes:>13,} {r.stored_bytes:>13,} {r.savings:>7.1%}"
        )
    raw = sum(r.raw_bytes for r in report)
    stored = sum(r.stored_bytes for r in report)
    saved = 1.0 - stored / raw if raw else 0.0
    lines.append(f"{'total':<{w}} {'':>12} {raw:>13,} {stored:>13,} {saved:>7.1%}")
    return "\n".join(lines)


def pooled_error_bound(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor) -> Tensor:
    """Elementwise bound on |compressed - torchrec| pooled outputs, [B, sum of dims] float64.

    Both modules pool the same bit-exact rows in fp32, possibly in different orders. Recursive
    fp32 summation of a bag of L (weighted) rows obeys |fl(S) - S| <= gamma_L * sum_i |w_i x_i| with
    gamma_L = L u / (1 - L u), u = 2^-24 (Higham, *Accuracy and Stability of Numerical Algorithms*,
    sec. 3.1; the bound for inner products also covers rounding the products). Each side is within
    that of the exact sum, so they differ by at most twice it. MEAN adds one rounded division per
    side (2 u |mean|). torchrec returns FP16 tables' sums rounded to fp16 while this module returns
    the fp32 sum, so FP16 tables add u16 |S| with u16 = 2^-11.

    Parameters
    ----------
    ebc : the float torchrec collection the compressed module was built from.
    features : the batch both modules pooled.
    """
    u32, u16 = 2.0**-24, 2.0**-11
    per_feature = features.to_dict()
    bounds = []
    for config in ebc.embedding_bag_configs():
        weight = ebc.embedding_bags[config.name].weight.detach().double()
        for feature in config.feature_names:
            jt = per_feature[feature]
            w = jt.weights_or_none() if ebc.is_weighted() else None
            w = None if w is None else w.double()
            lengths = jt.lengths().double()[:, None]
            bag = torch.nn.functional.embedding_bag
            exact = bag(jt.values(), weight, jt.offsets(), mode="sum", per_sample_weights=w,
                        include_last_offset=True)  # fmt: skip
            abs_sum = bag(jt.values(), weight.abs(), jt.offsets(), mode="sum",
                          per_sample_weights=None if w is None else w.abs(),
                          include_last_offset=True)  # fmt: skip
            bound = 2 * lengths * u32 / (1 - lengths * u32) * abs_sum
            if config.pooling == PoolingType.MEAN:
                count = lengths.clamp(min=1)
                exact, bound = exact / count, bound / count
                bound = bound + 2 * u32 * exact.abs()
            if config.data_type == DataType.FP16:
                bound = bound + u16 * exact.abs()
            bounds.append(bound)
    return torch.cat(bounds, dim=1)
