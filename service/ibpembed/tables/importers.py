# SPDX-License-Identifier: Apache-2.0
"""Turn model weights into a ``TableSet``: tables plus the feature -> table mapping.

Sources: torch tensors and ``.pt`` state dicts, torchrec ``EmbeddingBagCollection`` (module or
state dict with its configs), fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen`` weights,
safetensors files and ``.npy`` files (memory-mapped), or a directory holding such files.

Every importer hands the rows over as they are, bit for bit: float tables keep their dtype,
fbgemm row-wise int8 rows keep their fp16 scale/bias header, int4 rows stay packed. Everything is
checked (shapes, dtypes, unique names) before a single table is packed, so a bad source never
leaves a half-written table set.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ibpembed import codec

if TYPE_CHECKING:  # fbgemm is optional: imported where it is used
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

_EBC_KEY = re.compile(r"(?:^|\.)embedding_bags\.(?P<table>[^.]+)\.weight$")
_POOLING_NAMES = {"SUM": "sum", "MEAN": "mean", "NONE": None}
_FBGEMM_POOLING = {0: "sum", 1: "mean", 2: None}  # fbgemm PoolingMode values
_SOURCE_SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")


class SourceError(ValueError):
    """A source that cannot become a table set: names the source and the table."""


@dataclass(frozen=True)
class TableSource:
    """One table to pack.

    Attributes
    ----------
    name : table name (unique in its set).
    weight : [N, D] contiguous CPU tensor, in the dtype it is stored in.
    quant : ``"int8_rowwise"`` for fbgemm row-wise int8 rows (fp16 scale, fp16 bias, codes).
    feature_names : features looked up in this table; empty means the table name itself.
    pooling : the model's pooling for this table (``"sum"``, ``"mean"`` or None), informational:
        requests choose their pooling.
    origin : where the table came from, for the pack report and the file's metadata.
    layout : a note for rows the codec treats as plain bytes, e.g. ``"fbgemm_int4_rowwise"``.
    """

    name: str
    weight: torch.Tensor
    quant: str | None = None
    feature_names: tuple[str, ...] = ()
    pooling: str | None = None
    origin: str = ""
    layout: str | None = None

    @property
    def features(self) -> tuple[str, ...]:
        return self.feature_names or (self.name,)


@dataclass(frozen=True)
class TableSet:
    """Tables to pack together, checked on construction."""

    tables: tuple[TableSource, ...]
    extra_features: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for source in self.tables:
            if not source.name:
                raise SourceError(f"{source.origin}: a table has an empty name")
            if source.name in seen:
                raise SourceError(f"{source.origin}: table '{source.name}' appears twice")
            seen.add(source.name)
            try:
                codec.validate_table(source.weight, source.quant)
            except (TypeError, ValueError) as exc:
                raise SourceError(f"{source.origin}: table '{source.name}': {exc}") from None
        for feature, table in self.extra_features.items():
            if table not in seen:
                raise SourceError(
                    f"feature '{feature}' maps to table '{table}', which is not among the tables "
                    f"packed {sorted(seen)}: a feature maps only to a table packed with it (for a "
                    "table a merge keeps, pack that table again)"
                )
        served = set(self.features().values())  # raises on a feature claimed by two tables
        for source in self.tables:
            if source.name not in served:
                # Lookups name features: packed, such a table would be stored and loaded but
                # read by nothing. Usually a slip: `--feature a=b` meant as an alias of b.
                moved = ", ".join(
                    f"{f}={t}" for f, t in self.extra_features.items() if f in source.features
                )
                raise SourceError(
                    f"--feature {moved} maps every feature of table '{source.name}' to another "
                    f"table, leaving nothing to look '{source.name}' up with: give the new feature "
                    f"a name of its own, or leave table '{source.name}' out (--table)"
                )

    def features(self) -> dict[str, str]:
        """feature -> table: each table's features, then ``extra_features``."""
        mapping: dict[str, str] = {}
        for source in self.tables:
            for feature in source.features:
                if mapping.setdefault(feature, source.name) != source.name:
                    raise SourceError(
                        f"feature '{feature}' is mapped to both '{mapping[feature]}' and "
                        f"'{source.name}'"
                    )
        mapping.update(self.extra_features)
        return mapping

    def select(self, names: Iterable[str]) -> TableSet:
        """Only the named tables (in the given order)."""
        by_name = {s.name: s for s in self.tables}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SourceError(f"no table named {missing}; have {sorted(by_name)}")
        keep = tuple(by_name[n] for n in names)
        kept = {s.name for s in keep}
        extra = {f: t for f, t in self.extra_features.items() if t in kept}
        return TableSet(keep, extra)


def _rows(weight: torch.Tensor, origin: str, name: str) -> torch.Tensor:
    """The weight as a contiguous CPU tensor, without a copy when it already is one."""
    if not isinstance(weight, torch.Tensor):
        raise SourceError(f"{origin}: table '{name}' is a {type(weight).__name__}, not a tensor")
    if weight.device.type == "meta":
        raise SourceError(f"{origin}: table '{name}' is on the meta device (not materialised)")
    if weight.layout != torch.strided:  # sparse COO, CSR, ...: no rows to pack as they are
        raise SourceError(
            f"{origin}: table '{name}' is a sparse tensor ({weight.layout}), not dense rows; "
            "pick the tables to pack by name (ibpembed pack --table NAME)"
        )
    weight = weight.detach()
    if weight.device.type != "cpu":
        weight = weight.cpu()
    return weight.contiguous()


# -- plain tensors and state dicts -----------------------------------------------------------


def from_tensor(weight: torch.Tensor, name: str = "table", *, origin: str = "tensor") -> TableSet:
    """One table from one [N, D] tensor."""
    return TableSet((TableSource(name, _rows(weight, origin, name), origin=origin),))


def _flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    # Checkpoints often nest the state dict ({"model": {...}}); dotted keys keep names unique.
    flat: dict[str, Any] = {}
    for key, value in state.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{full}."))
        else:
            flat[full] = value
    return flat


def from_state_dict(
    state: Mapping[str, Any],
    *,
    keys: Sequence[str] | None = None,
    tables: Iterable[str] | None = None,
    origin: str = "state dict",
) -> TableSet:
    """Tables from a state dict.

    Parameters
    ----------
    keys : the entries to import (table name = key). By default: the torchrec
        ``...embedding_bags.<table>.weight`` entries if there are any (table name = ``<table>``),
        else every 2-D tensor (dense layers of a checkpoint included; pass ``keys`` to choose).
    tables : import only the tables of these names (possibly none), chosen before any entry is
        checked: the other entries may be anything.
    """
    flat = _flatten(state)
    if keys is not None:
        missing = [k for k in keys if k not in flat]
        if missing:
            raise SourceError(f"{origin}: no entries {missing}")
        chosen = {k: k for k in keys}
    else:
        chosen = _default_entries(_ndims(flat))
    if tables is not None:
        wanted = set(tables)
        chosen = {k: name for k, name in chosen.items() if name in wanted}
    elif not chosen:
        raise SourceError(f"{origin}: no 2-D tensors to import")
    return TableSet(
        tuple(
            TableSource(name, _rows(flat[key], origin, name), origin=origin)
            for key, name in chosen.items()
        )
    )


def _ndims(flat: Mapping[str, Any]) -> dict[str, int | None]:
    """Each entry's number of dimensions (None for what is not a tensor)."""
    return {k: v.dim() if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def _default_entries(ndims: Mapping[str, int | None]) -> dict[str, str]:
    """key -> table name of the entries a state dict contributes by default (see
    ``from_state_dict``), from each entry's number of dimensions: a safetensors file gives
    them without reading any data."""
    torchrec = {k: m["table"] for k in ndims if (m := _EBC_KEY.search(k))}
    return torchrec or {k: k for k, n in ndims.items() if n == 2}


# -- torchrec --------------------------------------------------------------------------------


def _pooling_name(pooling: Any) -> str | None:
    return _POOLING_NAMES.get(getattr(pooling, "name", str(pooling)).upper())


def from_torchrec_state_dict(
    state: Mapping[str, torch.Tensor], configs: Sequence[Any], *, origin: str = "torchrec"
) -> TableSet:
    """Tables of a torchrec EmbeddingBagCollection from its state dict and its table configs.

    Parameters
    ----------
    state : ``ebc.state_dict()`` (keys ``[prefix.]embedding_bags.<table>.weight``).
    configs : ``ebc.embedding_bag_configs()`` (``EmbeddingBagConfig``: name, num_embeddings,
        embedding_dim, feature_names, pooling).

    Raises
    ------
    SourceError
        when a config's table is missing from the state dict or its weight's shape differs from
        [num_embeddings, embedding_dim].
    """
    weights = {m["table"]: v for k, v in _flatten(state).items() if (m := _EBC_KEY.search(k))}
    sources = []
    for config in configs:
        if config.name not in weights:
            raise SourceError(f"{origin}: table '{config.name}' has no weight in the state dict")
        weight = weights[config.name]
        expected = (config.num_embeddings, config.embedding_dim)
        if tuple(weight.shape) != expected:
            raise SourceError(
                f"{origin}: table '{config.name}' weight has shape {tuple(weight.shape)}, its "
                f"config says {list(expected)}"
            )
        sources.append(
            TableSource(
                config.name,
                _rows(weight, origin, config.name),
                feature_names=tuple(config.feature_names),
                pooling=_pooling_name(config.pooling),
                origin=origin,
            )
        )
    return TableSet(tuple(sources))


def from_torchrec(module: torch.nn.Module, *, origin: str | None = None) -> TableSet:
    """Tables of every torchrec ``EmbeddingBagCollection`` in ``module`` (or ``module`` itself).

    Float collections and quantized ones (``torchrec.quant``, e.g. from
    ``EmbeddingBagCollection.from_float``) are both read; quantized tables come through their
    fbgemm modules exactly as ``from_fbgemm`` reads them. Table names, feature names and pooling
    come from the collection's configs; tables of nested collections keep their own names, which
    must be unique across the model.
    """
    from torchrec import EmbeddingBagCollection
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    kinds = (EmbeddingBagCollection, QuantEmbeddingBagCollection)
    collections = [(p, m) for p, m in module.named_modules() if isinstance(m, kinds)]
    if not collections:
        raise SourceError(f"{type(module).__name__} holds no torchrec EmbeddingBagCollection")
    sources: list[TableSource] = []
    for prefix, ebc in collections:
        where = origin or f"torchrec:{prefix or type(module).__name__}"
        configs = ebc.embedding_bag_configs()
        if isinstance(ebc, EmbeddingBagCollection):
            sources.extend(from_torchrec_state_dict(ebc.state_dict(), configs, origin=where).tables)
            continue
        # NOTE(tables): torchrec keeps a quantized collection's rows only in its fbgemm modules
        # (``_emb_modules``, one per data type); their specs carry the table names.
        found = {
            s.name: s for tbe in ebc._emb_modules for s in from_fbgemm(tbe, origin=where).tables
        }
        for config in configs:
            sources.append(
                dataclasses.replace(
                    found[config.name],
                    feature_names=tuple(config.feature_names),
                    pooling=_pooling_name(config.pooling),
                )
            )
    return TableSet(tuple(sources))


# -- fbgemm ----------------------------------------------------------------------------------


def from_fbgemm(
    tbe: IntNBitTableBatchedEmbeddingBagsCodegen,
    names: Sequence[str] | None = None,
    *,
    origin: str = "fbgemm",
) -> TableSet:
    """Tables of an fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen``, rows as stored.

    INT8 rows become uint8 ``[E, 4 + D]`` in the ``int8_rowwise`` layout (fp16 scale, fp16 bias,
    D codes: fbgemm's own row layout), INT4 rows uint8 ``[E, 4 + D/2]`` (scale, bias, packed
    nibbles; gather only), FP16/FP32 rows their float dtype. Row padding fbgemm may add for
    alignment is dropped; the values are untouched.

    Parameters
    ----------
    names : table names; default the names in ``embedding_specs``, else ``table_<i>``.
    """
    from fbgemm_gpu.split_embedding_configs import SparseType

    specs = list(tbe.embedding_specs)
    weights = tbe.split_embedding_weights()
    if names is None:
        names = [spec[0] or f"table_{i}" for i, spec in enumerate(specs)]
    if len(names) != len(specs):
        raise SourceError(f"{origin}: {len(names)} names for {len(specs)} tables")
    features = getattr(tbe, "feature_names_per_table", None) or [[] for _ in specs]
    pooling = _FBGEMM_POOLING.get(int(getattr(tbe, "pooling_mode", 0)))
    sources = []
    for i, (name, spec, (qweight, scale_bias)) in enumerate(
        zip(names, specs, weights, strict=True)
    ):
        rows, dim, weight_ty = spec[1], spec[2], spec[3]
        quant, layout = None, None
        if weight_ty == SparseType.INT8:
            weight = torch.cat([scale_bias, qweight[:, :dim]], dim=1)
            quant = "int8_rowwise"
        elif weight_ty == SparseType.INT4:
            weight = torch.cat([scale_bias, qweight[:, : dim // 2]], dim=1)
            layout = "fbgemm_int4_rowwise"
        elif weight_ty == SparseType.FP16:
            weight = qweight[:, : 2 * dim].contiguous().view(torch.float16)
        elif weight_ty == SparseType.FP32:
            weight = qweight[:, : 4 * dim].contiguous().view(torch.float32)
        else:
            raise SourceError(
                f"{origin}: table '{name}' has weight type {weight_ty}, which has "
                "no lossless row form here (INT8, INT4, FP16, FP32 do)"
            )
        if weight.shape[0] != rows:
            raise SourceError(
                f"{origin}: table '{name}' has {weight.shape[0]} rows, spec says {rows}"
            )
        sources.append(
            TableSource(
                name,
                _rows(weight, origin, name),
                quant=quant,
                feature_names=tuple(features[i]) if i < len(features) else (),
                pooling=pooling,
                origin=origin,
                layout=layout,
            )
        )
    return TableSet(tuple(sources))


# -- files -----------------------------------------------------------------------------------


def from_npy(path: str | os.PathLike[str], name: str | None = None) -> TableSet:
    """One table from a 2-D ``.npy`` file, memory-mapped (copy-on-write, never written back).

    An array in the other byte order is byte-swapped into memory (a copy; the same values, bit
    for bit).
    """
    path = Path(path)
    try:
        array = np.load(path, mmap_mode="c")
    except Exception as exc:  # numpy raises many types for a bad file; the cause stays chained
        raise SourceError(f"{path}: cannot load with numpy.load: {exc}") from exc
    if not isinstance(array, np.ndarray):  # an .npz archive under an .npy name
        array.close()
        raise SourceError(f"{path}: holds a {type(array).__name__}, not an array")
    if array.ndim != 2:
        raise SourceError(f"{path}: expected a 2-D array, got shape {array.shape}")
    if not array.dtype.isnative:
        array = array.byteswap().view(array.dtype.newbyteorder("="))
    try:
        weight = torch.from_numpy(array)
    except (TypeError, ValueError):
        raise SourceError(f"{path}: unsupported array dtype {array.dtype}") from None
    return from_tensor(weight, name or path.stem, origin=str(path))


def from_safetensors(
    path: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    tables: Iterable[str] | None = None,
) -> TableSet:
    """Tables from a safetensors file (bf16 included), chosen as in ``from_state_dict``."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as exc:  # SafetensorError, OSError, ...; the cause stays chained
        raise SourceError(f"{path}: cannot load with safetensors: {exc}") from exc
    return from_state_dict(state, keys=keys, tables=tables, origin=str(path))


def from_pt(
    path: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    tables: Iterable[str] | None = None,
) -> TableSet:
    """Tables from a ``torch.save`` file: a tensor or a (possibly nested) state dict, chosen as
    in ``from_state_dict`` (a lone tensor is the table named after the file).

    Loaded with ``weights_only=True`` (no pickled code runs) and ``mmap=True`` (no copy).
    """
    path = Path(path)
    obj = _torch_load(path)
    if isinstance(obj, torch.Tensor):
        if tables is not None and path.stem not in set(tables):
            return TableSet(())
        return from_tensor(obj, path.stem, origin=str(path))
    if isinstance(obj, Mapping):
        return from_state_dict(obj, keys=keys, tables=tables, origin=str(path))
    raise SourceError(f"{path}: holds a {type(obj).__name__}, not a tensor or a state dict")


def load_sources(
    paths: Sequence[str | os.PathLike[str]], *, tables: Sequence[str] | None = None
) -> TableSet:
    """A table set from files and directories (``.pt/.pth``, ``.safetensors``, ``.npy``).

    A directory contributes every such file directly inside it. Table names must be unique
    across all files.

    Parameters
    ----------
    tables : only these tables, in this order (``TableSet.select``); the selection applies
        before anything is checked, so other entries of a checkpoint (e.g. an int64 position-id
        matrix) do not stop it.
    """
    files: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            listed = sorted(p for p in entry.iterdir() if p.suffix in _SOURCE_SUFFIXES)
            if not listed:
                raise SourceError(f"{entry}: no {', '.join(_SOURCE_SUFFIXES)} files")
            files.extend(listed)
        elif entry.exists():
            files.append(entry)
        else:
            raise SourceError(f"{entry}: no such file or directory")
    sources: list[TableSource] = []
    for path in files:
        if path.suffix == ".npy":
            if tables is not None and path.stem not in tables:
                continue
            found = from_npy(path)
        elif path.suffix == ".safetensors":
            found = from_safetensors(path, tables=tables)
        elif path.suffix in (".pt", ".pth"):
            found = from_pt(path, tables=tables)
        else:
            raise SourceError(f"{path}: unknown source type (expected {_SOURCE_SUFFIXES})")
        sources.extend(found.tables)
    table_set = TableSet(tuple(sources))
    if tables is None:
        return table_set
    found_names = {s.name for s in table_set.tables}
    missing = [name for name in tables if name not in found_names]
    if missing:
        held = sorted({name for path in files for name in table_names(path)})
        raise SourceError(f"no table named {missing}; the sources hold {held}")
    return table_set.select(tables)


def table_names(path: Path) -> list[str]:
    """The tables ``load_sources`` would import from ``path`` with no selection (nothing is
    checked): for naming them when a selection finds nothing."""
    if path.suffix == ".npy":
        return [path.stem]
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            ndims = {k: len(f.get_slice(k).get_shape()) for k in names}  # shapes only, no data
        return list(_default_entries(ndims).values())
    obj = _torch_load(path)
    if isinstance(obj, torch.Tensor):
        return [path.stem]
    if isinstance(obj, Mapping):
        return list(_default_entries(_ndims(_flatten(obj))).values())
    return []


def _torch_load(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (no pickled code runs) and ``mmap=True`` (no
    copy); a file it cannot load is a SourceError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a bad file; the cause stays chained
        raise SourceError(f"{path}: cannot load with torch.load: {exc}") from exc
