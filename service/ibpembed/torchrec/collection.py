# SPDX-License-Identifier: Apache-2.0
"""A drop-in, losslessly compressed replacement for torchrec's ``EmbeddingBagCollection``.

``CompressedEmbeddingBagCollection`` answers ``forward(KeyedJaggedTensor) -> KeyedTensor`` exactly
like the ``EmbeddingBagCollection`` it was built from (same keys, order, dims and pooling per
table), but keeps every table IBP-compressed in host memory and pools through
``torch.ops.ibpembed.lookup_pooled`` (one ``CompressedEmbeddingBag`` per table). Inference only:
there are no gradients and no optimizer state.

This file is written in the TorchScript subset, like ``bag.py``.
"""

import os
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ibpembed.codec import CompressedTable, compress
from ibpembed.engine.tier import DEFAULT_BUDGET as DEFAULT_HOT_ROW_BUDGET
from ibpembed.engine.tier import top_hot_rows
from ibpembed.layout import DTYPE_CODES
from ibpembed.tables.manifest import Manifest, load_table_set
from ibpembed.tables.tier_budget import TableSize, TierBudget
from ibpembed.torchrec.bag import DATA_TYPES, POOLING_CODES, TORCH_DTYPES, CompressedEmbeddingBag
from ibpembed.torchrec.report import TableReport


class CompressedEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """torchrec ``EmbeddingBagCollection`` for inference, with IBP-compressed host tables.

    Build it with :meth:`from_ebc`, :meth:`from_table_set`, or from configs and ``load_state_dict``.
    ``forward`` returns the ``KeyedTensor`` torchrec's module would: keys in table order (a feature
    shared by several tables is named ``feature@table``), ``length_per_key`` the table dims, fp32
    values pooled with each table's SUM or MEAN. Weighted collections (``is_weighted=True``)
    multiply each row by the KJT's weight; as in torchrec, weights are ignored otherwise. A KJT
    with inverse indices (a deduplicated batch) is expanded by them, as torchrec does.

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
            try:
                self.embedding_bags[config.name] = CompressedEmbeddingBag(
                    config.num_embeddings,
                    config.embedding_dim,
                    TORCH_DTYPES[config.data_type],
                    config.pooling,
                    table,
                )
            except ValueError as exc:
                raise ValueError(f"table {config.name!r}: {exc}") from None
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
        self._known_feature_list: list[str] = sorted({f for c in configs for f in c.feature_names})
        # Output j pools feature _output_features[j] with table _output_tables[j].
        self._output_features: list[str] = [f for c in configs for f in c.feature_names]
        self._output_tables: list[int] = [i for i, c in enumerate(configs) for _ in c.feature_names]
        self._dtype_codes: list[int] = [DTYPE_CODES[TORCH_DTYPES[c.data_type]] for c in configs]
        self._pooling_codes: list[int] = [POOLING_CODES[c.pooling] for c in configs]

    @classmethod
    def from_ebc(
        cls, ebc: EmbeddingBagCollection, allow_unknown_keys: bool = False, **compress_kwargs: Any
    ) -> "CompressedEmbeddingBagCollection":
        """Compress every table of a float torchrec ``EmbeddingBagCollection``.

        Each table keeps its weight's dtype, and the new module's config says it: torchrec
        holds every table whose config is not FP32 (BF16 included) as fp16 weights, and
        ``.half()`` or ``.to(torch.bfloat16)`` casts them without touching the configs.

        Parameters
        ----------
        ebc : the module to replace; its weights are read, never modified.
        allow_unknown_keys : see the class docstring.
        **compress_kwargs : passed to :func:`ibpembed.compress` (``method``, ``align``, ...).

        Raises
        ------
        TypeError
            for a table whose weights are not float32, float16 or bfloat16 (naming it).
        ValueError
            for a table on the meta device (naming it).
        """
        if not isinstance(ebc, EmbeddingBagCollection):
            raise TypeError(f"expected a torchrec EmbeddingBagCollection, got {type(ebc).__name__}")
        configs = []
        compressed = {}
        for config in ebc.embedding_bag_configs():
            weight = ebc.embedding_bags[config.name].weight.detach()
            if weight.device.type == "meta":
                raise ValueError(f"table {config.name!r} is on the meta device: no weights")
            configs.append(config_with_weight_dtype(config, weight))
            compressed[config.name] = compress(weight.cpu().contiguous(), **compress_kwargs)
        return cls(configs, ebc.is_weighted(), compressed, allow_unknown_keys=allow_unknown_keys)

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

        Tables keep the pooling their manifest records (tables packed without a pooling pool
        with SUM, torchrec's default) and read the features it maps to them, as the server
        serves them: those packed with the table, in their order, then those mapped with
        ``ibpembed pack --feature F=T``, in the manifest's (sorted) order. A table packed from a
        state dict, which holds no feature names, is recorded under its own name; once features
        are mapped to it that name is dropped, so the model's KJT keys are what it reads. A table
        no feature maps to (a merge mapped its features to another table) serves no lookup, on a
        server or here. The payloads stay memory-mapped from the table files until rows are read.

        Parameters
        ----------
        directory : the table set (its ``manifest.json`` and ``.ibpt`` files); whole tables
            only: a row shard (``ibpembed pack --shards``) holds some of a table's rows, which
            the servers of every shard answer together (``RemoteEmbeddingBagCollection``).
        tables : table names in the order the output ``KeyedTensor`` should list them (pass
            ``[c.name for c in ebc.embedding_bag_configs()]`` to match a model); default: every
            table a feature maps to, in manifest order.
        is_weighted, allow_unknown_keys : see the class docstring.
        verify : hash every payload while loading (see ``ibpembed.tables.load_table_set``).

        Raises
        ------
        KeyError
            for a name in ``tables`` the set does not hold.
        ValueError
            for a row shard of a table, a table no feature maps to, and tables torchrec cannot
            pool as floats (row-wise int8, int8/uint8 rows).
        """
        manifest, compressed = load_table_set(directory, verify=verify)
        served = set(manifest.features.values())
        names = [n for n in manifest.tables if n in served] if tables is None else tables
        configs = []
        for name in names:
            if name not in manifest.tables:
                raise KeyError(f"table '{name}' is not in the table set {directory}")
            entry = manifest.tables[name]
            rows = entry.row_range
            if not rows.is_whole:
                # Its ids are global rows [start, end) of a larger table: read as a table of
                # its own, id 0 would be row `start`.
                raise ValueError(
                    f"table '{name}' of {directory} is a row shard (rows [{rows.start}, "
                    f"{rows.end}) of {rows.total}): a collection holds whole tables; serve each "
                    "shard and use RemoteEmbeddingBagCollection.from_server([shard addresses]), "
                    "or pack the table without --shards"
                )
            if name not in served:
                raise ValueError(
                    f"table '{name}' of {directory}: no feature maps to it (its features map to "
                    "other tables), so no lookup can read it"
                )
            if entry.quant is not None or entry.dtype not in DATA_TYPES:
                raise ValueError(
                    f"table '{name}' holds {entry.dtype} rows (quant={entry.quant}): only "
                    f"float32, float16 and bfloat16 tables can back an EmbeddingBagCollection"
                )
            configs.append(
                EmbeddingBagConfig(
                    name=name,
                    embedding_dim=entry.dim,
                    num_embeddings=entry.num_rows,
                    feature_names=_manifest_features(manifest, name),
                    pooling=PoolingType.MEAN if entry.pooling == "mean" else PoolingType.SUM,
                    data_type=DATA_TYPES[entry.dtype],
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
    def table_bytes(self, module: str = "") -> list[TableReport]:
        """Host bytes per table: dense torchrec weight vs everything the compressed table keeps."""
        report = []
        for name in self._table_names:
            t = self._bag(name).compressed_table()
            report.append(
                TableReport(
                    module, name, t.num_rows, t.dim, t.raw_bytes, t.stored_bytes, t.hot_bytes
                )
            )
        return report

    @torch.jit.unused
    def cache_hot_rows(
        self, batches: list[KeyedJaggedTensor], budget: float | str = DEFAULT_HOT_ROW_BUDGET
    ) -> dict[str, int]:
        """Keep decoded copies of each table's most frequent rows in ``batches`` (a sample of
        real traffic), ranked as the server ranks them (``ibpembed.engine.tier``). CPU forwards
        then read those rows instead of decoding them; outputs do not change. Call it again to
        re-rank.

        ``budget``: a share of each table's raw bytes (0.01 for 1 %; 0 drops the tier), or one
        of the server's ``--hot-tier`` spellings (``ibpembed.tables.tier_budget``): ``"1%"``,
        ``"savings"`` (the largest tier that keeps each table within its raw bytes),
        ``"50%savings"``, ``"all"`` (every row, sampled or not), ``"256MiB"`` (for all the
        tables, split by their raw bytes) or ``"off"``. ValueError for anything else.

        Returns the rows cached per table.
        """
        capacities = self._hot_row_capacities(budget)
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
            bag = self._bag(name)
            ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
            table = bag.compressed_table()
            rows = capacities[name]
            if rows >= table.num_rows:
                chosen = torch.arange(table.num_rows)
            else:
                chosen = top_hot_rows(table, ids, rows)[0] if rows > 0 else ids[:0]
            cached[name] = bag.set_hot_rows(chosen)
        return cached

    def _bag(self, name: str) -> CompressedEmbeddingBag:
        """Table ``name``'s module (ModuleDict hands out plain ``nn.Module``s)."""
        bag = self.embedding_bags[name]
        assert isinstance(bag, CompressedEmbeddingBag), "__init__ fills embedding_bags"
        return bag

    def _hot_row_capacities(self, budget: float | str) -> dict[str, int]:
        """The tier rows ``budget`` buys each table (cache_hot_rows)."""
        if isinstance(budget, str):
            parsed = TierBudget.parse(budget, setting="cache_hot_rows")
        elif isinstance(budget, bool) or not isinstance(budget, int | float):
            raise ValueError(f"budget must be a share or a --hot-tier spelling, got {budget!r}")
        elif not 0.0 <= budget <= 1.0:
            raise ValueError(f"budget must be a share in [0, 1] of the raw bytes, got {budget}")
        else:
            parsed = TierBudget("raw", float(budget))
        sizes = {
            name: TableSize.of(self._bag(name).compressed_table()) for name in self._table_names
        }
        return {name: plan.rows for name, plan in parsed.plan(sizes).items()}

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature with its table; see the class docstring for the checks.

        One ``torch.ops.ibpembed.pooled_collection`` call does the whole batch: the checks that
        read ids and lengths run inside it, so graph captures (torch.export,
        ``torch.compile(fullgraph=True)``, torchrec's FX tracer) see one op with a fake kernel.

        Parameters
        ----------
        features : KJT with keys F, int32/int64 values [nnz], lengths [F * B] and, for a weighted
            collection, weights [nnz].

        Returns
        -------
        KeyedTensor with values [B, sum of dims] float32, keys as torchrec's module would give.
        """
        parts = _kjt_parts(
            features,
            self._output_features,
            self._known_feature_list,
            self._allow_unknown_keys,
            self._is_weighted,
        )
        payload: list[Tensor] = []
        block_base: list[Tensor] = []
        row_units: list[Tensor] = []
        bitmask: list[Tensor] = []
        mask: list[Tensor] = []
        bitval: list[Tensor] = []
        hot_dir: list[Tensor] = []
        hot_rows: list[Tensor] = []
        chunk_bits: list[int] = []
        row_bytes: list[int] = []
        unit_bytes: list[int] = []
        for bag in self.embedding_bags.values():
            # Narrows the ModuleDict's nn.Module for the type checker; TorchScript scripts it.
            assert isinstance(bag, CompressedEmbeddingBag), "__init__ fills embedding_bags"
            if bag.chunk_bits == 0:
                raise RuntimeError(
                    "CompressedEmbeddingBag has no table: build it with a CompressedTable or "
                    "load_state_dict into it"
                )
            payload.append(bag.payload)
            block_base.append(bag.block_base)
            row_units.append(bag.row_units)
            bitmask.append(bag.bitmask)
            mask.append(bag.mask)
            bitval.append(bag.bitval)
            hot_dir.append(bag.hot_dir)
            hot_rows.append(bag.hot_rows)
            chunk_bits.append(bag.chunk_bits)
            row_bytes.append(bag.row_bytes)
            unit_bytes.append(bag.unit_bytes)
        values = torch.ops.ibpembed.pooled_collection(
            payload,
            block_base,
            row_units,
            bitmask,
            mask,
            bitval,
            hot_dir,
            hot_rows,
            chunk_bits,
            row_bytes,
            unit_bytes,
            self._num_embeddings,
            self._dtype_codes,
            self._pooling_codes,
            parts[0],
            parts[1],
            parts[2],
            parts[3],
            parts[4],
            parts[5],
            self._output_tables,
            self._output_features,
            self._table_names,
        )
        values = expand_inverse_indices(
            values,
            features.inverse_indices_or_none(),
            self._output_features,
            self._lengths_per_embedding,
        )
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
        )


# NOTE: torch.fx.wrap keeps this out of symbolic tracing (the key checks iterate the KJT's keys,
# which FX cannot do on a proxy): traces record one call, and TorchScript scripts it as usual.
@torch.fx.wrap
def _kjt_parts(
    features: KeyedJaggedTensor,
    output_features: list[str],
    known: list[str],
    allow_unknown_keys: bool,
    is_weighted: bool,
) -> tuple[Tensor, Tensor, Tensor | None, int, int, list[int]]:
    """The KJT's checks that need no id or length value (keys, VBE, dtypes, weights present),
    then (values int64, lengths int64, weights fp32 or None, batch size, number of keys, the
    KJT position of each output's feature)."""
    keys = features.keys()
    if not allow_unknown_keys:
        for key in keys:
            if key not in known:
                raise KeyError(f"KJT key '{key}' is not read by any table; known: {sorted(known)}")
    present: dict[str, int] = {k: i for i, k in enumerate(keys)}
    for feature in known:
        if feature not in present:
            raise KeyError(f"feature '{feature}' is missing from the KJT (keys: {keys})")
    if features.variable_stride_per_key():
        raise NotImplementedError("variable-batch (VBE) KeyedJaggedTensors are not supported")
    values = features.values()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"KJT values must be integer ids, got {values.dtype}")
    weights: Tensor | None = None
    if is_weighted:
        given = features.weights_or_none()
        if given is None:
            raise ValueError("this collection is weighted: the KJT must carry weights")
        weights = given.to(torch.float32).contiguous()
    output_key = [present[f] for f in output_features]
    return (
        values.to(torch.int64).contiguous(),
        features.lengths().to(torch.int64).contiguous(),
        weights,
        features.stride(),
        len(keys),
        output_key,
    )


# NOTE: wrapped like _kjt_parts (it reads the KJT's key names); torchrec's own EBC wraps its
# inverse-index steps the same way.
@torch.fx.wrap
def expand_inverse_indices(
    pooled: Tensor,
    inverse_indices: tuple[list[str], Tensor] | None,
    output_features: list[str],
    dims: list[int],
) -> Tensor:
    """``pooled`` [B, sum of dims] expanded by a KJT's inverse indices, as torchrec's EBC does:
    [B', sum of dims] whose row b of output j is ``pooled``'s row ``index[k][b]``, k the KJT key
    of output j's feature (a deduplicated batch of B bags answering B' samples). Without
    inverse indices, ``pooled`` itself."""
    if inverse_indices is None:
        return pooled
    keys, index = inverse_indices
    position: dict[str, int] = {}
    for i, key in enumerate(keys):
        position[key] = i
    parts: list[Tensor] = []
    start = 0
    for j in range(len(output_features)):
        feature = output_features[j]
        if feature not in position:
            raise KeyError(f"feature '{feature}' has no inverse indices (the KJT's are for {keys})")
        rows = index[position[feature]].to(device=pooled.device, dtype=torch.int64)
        parts.append(pooled[:, start : start + dims[j]].index_select(0, rows))
        start += dims[j]
    if len(parts) == 0:
        return pooled.new_empty((index.shape[-1], 0))
    return torch.cat(parts, dim=1)


def config_with_weight_dtype(config: EmbeddingBagConfig, weight: Tensor) -> EmbeddingBagConfig:
    """``config`` with the data type of the weight torchrec pools it with.

    torchrec allocates fp16 weights for every config that is not FP32, and a module's
    ``.half()`` or ``.to(dtype)`` casts the weights but not the configs: the weight is what
    torchrec computes with, so it decides the table's dtype.
    """
    name = str(weight.dtype).removeprefix("torch.")
    if name not in DATA_TYPES:
        raise TypeError(
            f"table {config.name!r}: weights are {weight.dtype}; only float32, float16 and "
            "bfloat16 tables can be compressed"
        )
    return replace(config, data_type=DATA_TYPES[name])


def _manifest_features(manifest: Manifest, table: str) -> list[str]:
    """The features ``manifest`` maps to ``table``, in the order from_table_set documents."""
    mapped = [f for f, t in manifest.features.items() if t == table]
    packed = [f for f in manifest.tables[table].feature_names if f in mapped]
    explicit = [f for f in mapped if f not in packed]
    if explicit and packed == [table]:
        # The packer's stand-in for a source without feature names, not a feature of the model.
        packed = []
    return packed + explicit


def _checked_config(config: EmbeddingBagConfig) -> EmbeddingBagConfig:
    """A copy of ``config`` (the module must not share mutable configs with the source model)."""
    if config.pooling not in POOLING_CODES:
        raise ValueError(
            f"table {config.name!r}: pooling must be SUM or MEAN, got {config.pooling}"
        )
    if config.data_type not in TORCH_DTYPES:
        raise ValueError(
            f"table {config.name!r}: data_type must be FP32, FP16 or BF16, got {config.data_type}"
        )
    feature_names = list(config.feature_names) or [config.name]
    return replace(config, feature_names=feature_names)
