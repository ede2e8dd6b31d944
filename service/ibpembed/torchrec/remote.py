# SPDX-License-Identifier: Apache-2.0
"""A torchrec ``EmbeddingBagCollection`` whose tables live on ``ibpembed serve``.

``RemoteEmbeddingBagCollection`` answers ``forward(KeyedJaggedTensor) -> KeyedTensor`` like
torchrec's module (same keys, order, dims and pooling per table) by sending the whole batch to the
server as ONE ``Lookup`` request, so a model's host needs no table memory at all. Row-sharded
table sets (``ibpembed pack --shards N``) work too: pass every shard's address.

This module imports the gRPC client (``ibpembed-client``); ``ibpembed.torchrec`` loads it only
when ``RemoteEmbeddingBagCollection`` is first used, so the in-process modules stay grpc-free.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import grpc
import numpy as np
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ibpembed.torchrec.collection import config_with_weight_dtype, expand_inverse_indices
from ibpembed.torchrec.report import TableReport
from ibpembed_client import (
    FeatureBatch,
    LookupClient,
    LookupResult,
    LookupServiceError,
    ShardedLookupClient,
    TableInfo,
    build_request,
)
from ibpembed_client.shards import ShardMap

Client = LookupClient | ShardedLookupClient

# Codes that mean the server could not be asked at all (as opposed to an answer about the batch).
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RemoteLookupError(RuntimeError):
    """A lookup the server refused or could not answer; ``cause`` is the client's error.

    The message names the target and the features of the batch; for an answer about one
    feature (NOT_FOUND, INVALID_ARGUMENT) the server's own text names that feature.
    """

    def __init__(self, message: str, cause: LookupServiceError) -> None:
        super().__init__(message)
        self.cause = cause
        self.code = cause.code


def connect(
    target: str | Sequence[str], **client_options: Any
) -> tuple[Client, str, dict[str, TableInfo]]:
    """A client for ``target`` (one ``host:port``, or every shard's address), the target's name
    for messages, and every table it serves by name (its ListTables answers).

    For row-sharded servers each table is the whole logical table: the rows of all shards, the
    bytes summed over them. ``client_options`` are :class:`~ibpembed_client.LookupClient`'s
    (``timeout``, ``tls``, ``token``, ``retry``, ``max_message_bytes``).

    Raises
    ------
    ConnectionError
        when a server cannot be reached, naming it.
    """
    addresses = [target] if isinstance(target, str) else list(target)
    if not addresses:
        raise ValueError("target: no server address given")
    per_server: list[list[TableInfo]] = []
    for address in addresses:
        with LookupClient(address, **client_options) as probe:
            try:
                per_server.append(probe.list_tables())
            except LookupServiceError as err:
                raise ConnectionError(
                    f"ibpembed server {address}: cannot list its tables: {err}"
                ) from err
    if len(addresses) == 1:
        served = {t.name: t for t in per_server[0]}
        return LookupClient(addresses[0], **client_options), addresses[0], served
    shard_map = ShardMap.from_table_infos(addresses, per_server)
    served = {}
    for name, sharded in shard_map.tables.items():
        parts = [t for infos in per_server for t in infos if t.name == name]
        served[name] = dataclasses.replace(
            parts[0],
            num_rows=sharded.num_rows,
            raw_bytes=sum(t.raw_bytes for t in parts),
            stored_bytes=sum(t.stored_bytes for t in parts),
            row_start=0,
            row_end=sharded.num_rows,
        )
    client = ShardedLookupClient(shard_map, **client_options)
    return client, ",".join(addresses), served


class _SharedClient:
    """One client several collections use: the last of them to close closes it."""

    def __init__(self, client: Client, users: int) -> None:
        self.client = client
        self.users = users

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.client.close()


def remote_collections(
    ebcs: Sequence[EmbeddingBagCollection],
    target: str | Sequence[str],
    *,
    allow_unknown_keys: bool = False,
    allow_dtype_mismatch: bool = False,
    allow_table_name_mismatch: bool = False,
    **client_options: Any,
) -> list[RemoteEmbeddingBagCollection]:
    """A remote twin of each torchrec collection, all over one connection to ``target``.

    Each twin has its collection's configs, with each table's data type that of its weights
    (which torchrec pools), checked against the server. The connection closes once every twin
    has been closed, or before the error leaves when one cannot be built.
    """
    client, name, served = connect(target, **client_options)
    try:
        twins = [
            RemoteEmbeddingBagCollection(
                [
                    config_with_weight_dtype(c, ebc.embedding_bags[c.name].weight)
                    for c in ebc.embedding_bag_configs()
                ],
                client,
                name,
                served,
                is_weighted=ebc.is_weighted(),
                allow_unknown_keys=allow_unknown_keys,
                allow_dtype_mismatch=allow_dtype_mismatch,
                allow_table_name_mismatch=allow_table_name_mismatch,
            )
            for ebc in ebcs
        ]
    except BaseException:
        client.close()
        raise
    shared = _SharedClient(client, len(twins))
    for twin in twins:
        twin._shared = shared
    return twins


def _pooled_dim(info: TableInfo) -> int:
    # Row-wise int8 rows carry a 4-byte fp16 scale and bias before the codes; pooling drops them.
    return info.dim - 4 if info.quant == "int8_rowwise" else info.dim


# The rows a server table holds (its quantization, else its dtype) that each torchrec data type
# pools the same way. torchrec holds a BF16 config's table as fp16 weights, which is what a
# model packs; a bf16 table set (from_server) says BF16 too. INT8 is torchrec's row-wise int8.
_SERVED_ROWS: dict[DataType, tuple[str, ...]] = {
    DataType.FP32: ("float32",),
    DataType.FP16: ("float16",),
    DataType.BF16: ("bfloat16", "float16"),
    DataType.INT8: ("int8_rowwise",),
}


def _rows(info: TableInfo) -> str:
    return info.quant or info.dtype


def _data_type(info: TableInfo) -> DataType:
    """The torchrec data type of a served table; ValueError for rows that cannot be pooled."""
    for data_type, rows in _SERVED_ROWS.items():
        if _rows(info) == rows[0]:
            return data_type
    raise ValueError(
        f"table '{info.name}' holds {_rows(info)} rows, which cannot be pooled (float32, float16, "
        "bfloat16 and int8_rowwise tables can)"
    )


class RemoteEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """torchrec ``EmbeddingBagCollection`` for inference, looked up on an ibpembed server.

    Build it with :meth:`from_server` (configs from the server's ListTables) or from a model's
    own configs (``compress_model(model, remote=target)`` does that for every collection in a
    model); either way every feature is checked against the server first.

    ``forward`` sends ONE request per batch (every feature), pooled on the server, and returns
    the ``KeyedTensor`` torchrec's module would: keys in table order (each table's features in
    config order), ``length_per_key`` the table dims, float32 values. SUM and MEAN tables may be
    mixed: the request asks for SUM and MEAN features are divided by the bag length here, with
    the rounded fp32 reciprocal the server's kernels use, so the bits are the server's MEAN. A
    KJT with inverse indices (a deduplicated batch) is expanded by them, as torchrec does.
    :meth:`lookup_stream` pipelines many batches on one stream.

    Checks (before any request): ``KeyError`` for a KJT key no table reads (unless
    ``allow_unknown_keys``) or a feature missing from the KJT, ``ValueError`` for lengths that
    do not match the keys x batch or the values, or weights missing from a weighted
    collection's KJT; ``NotImplementedError`` for variable-batch (VBE) KJTs. Ids are checked by
    the server: a bad one fails the forward with :class:`RemoteLookupError` whose message is the
    server's (``feature 'f': id 9 out of range ...``).

    Parameters
    ----------
    tables : one config per table; every feature must be served, by the table of the config's
        name, dim and rows, holding rows its data type pools (FP32 float32, FP16 float16, BF16
        bfloat16 or float16, INT8 int8_rowwise). A feature read by two tables (torchrec's
        ``feature@table``) cannot be served: a server maps each feature to one table.
    client : a connected :class:`~ibpembed_client.LookupClient` or ``ShardedLookupClient``
        (see :func:`connect`); the module closes it in :meth:`close` only if ``owns_client``
        (or, built by :func:`remote_collections`, when the last collection sharing it closes).
    target : the server's name in error messages.
    is_weighted : whether the KJT's weights scale the rows.
    allow_unknown_keys : ignore KJT keys that no table reads instead of raising.
    served : the server's tables by name (:func:`connect` returns them).
    allow_dtype_mismatch : accept a served table whose rows differ from the config's data type
        (an FP32 model on a server holding float16 or int8_rowwise rows, to save its memory):
        the outputs are then the served rows' pooling, not the model's. Refused by default.
    allow_table_name_mismatch : accept a feature served from a table of another name than
        the config's (a set packed under other table names, the model's features mapped to them
        with ``ibpembed pack --feature``). Refused by default: crossed mappings (f0 to t1, f1 to
        t0) of tables of one shape would otherwise pool the wrong rows without a word.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        client: Client,
        target: str,
        served: dict[str, TableInfo],
        *,
        is_weighted: bool = False,
        allow_unknown_keys: bool = False,
        owns_client: bool = False,
        allow_dtype_mismatch: bool = False,
        allow_table_name_mismatch: bool = False,
    ) -> None:
        super().__init__()
        self._client = client
        self._target = target
        self._owns_client = owns_client
        self._shared: _SharedClient | None = None
        self._closed = False
        self._is_weighted = is_weighted
        self._allow_unknown_keys = allow_unknown_keys
        if len({c.name for c in tables}) != len(tables):
            raise ValueError("table names must be unique")
        configs = []
        for config in tables:
            if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(
                    f"table {config.name!r}: pooling must be SUM or MEAN, got {config.pooling}"
                )
            names = list(config.feature_names) or [config.name]
            # A copy: the module must not share mutable configs with the source model.
            configs.append(dataclasses.replace(config, feature_names=names))
        self._embedding_bag_configs = configs
        owner: dict[str, str] = {}
        for config in configs:
            for feature in config.feature_names:
                if owner.get(feature) == config.name:
                    raise ValueError(f"table '{config.name}' lists feature '{feature}' twice")
                if feature in owner:
                    raise ValueError(
                        f"feature '{feature}' is read by tables '{owner[feature]}' and "
                        f"'{config.name}': a server maps each feature to one table"
                    )
                owner[feature] = config.name
        self._served = served
        self._check_served(allow_dtype_mismatch, allow_table_name_mismatch)
        self._features: list[str] = [f for c in configs for f in c.feature_names]
        self._dims: list[int] = [c.embedding_dim for c in configs for _ in c.feature_names]
        self._mean: list[bool] = [
            c.pooling == PoolingType.MEAN for c in configs for _ in c.feature_names
        ]
        self._embedding_names: list[str] = [
            n for names in get_embedding_names_by_table(configs) for n in names
        ]
        self._pooling: Literal["sum", "mean"] = "mean" if all(self._mean) else "sum"

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_server(
        cls,
        target: str | Sequence[str],
        features: Sequence[str] | None = None,
        *,
        pooling: PoolingType | dict[str, PoolingType] = PoolingType.SUM,
        is_weighted: bool = False,
        allow_unknown_keys: bool = False,
        **client_options: Any,
    ) -> RemoteEmbeddingBagCollection:
        """A collection over what the server holds (its ListTables answer).

        Parameters
        ----------
        target : ``host:port``, or the address of every shard of a row-sharded table set.
        features : the features to look up, in output order (tables are ordered by their first
            listed feature; each reads the listed features it serves); default every feature of
            every poolable table, in the server's order.
        pooling : for every table, or per table name (missing names: SUM; a name the server
            does not serve as a table is refused). The server does not record a model's
            pooling, so it is said here.

        Each config's data type is the served table's: FP32, FP16, BF16, or INT8 for
        int8_rowwise rows (whose dim is the pooled dim).
        is_weighted, allow_unknown_keys : see the class docstring.
        **client_options : :class:`~ibpembed_client.LookupClient` options (``timeout``,
            ``tls``, ``token``, ``retry``, ``max_message_bytes``).

        Raises
        ------
        KeyError
            for a feature in ``features`` the server does not serve.
        ValueError
            for a feature listed twice in ``features`` or whose table holds rows that cannot
            be pooled, or a ``pooling`` name that is not a served table.
        ConnectionError
            when the server cannot be reached.
        """
        if features is not None and len(set(features)) < len(features):
            twice = next(f for f in features if list(features).count(f) > 1)
            raise ValueError(f"feature '{twice}' is listed twice in features")
        client, name, served = connect(target, **client_options)
        try:
            if isinstance(pooling, dict):
                unknown = sorted(set(pooling) - set(served))
                if unknown:
                    raise ValueError(
                        f"pooling names {unknown}, which {name} does not serve as tables (it "
                        f"serves {sorted(served)}); pooling is given per table, not per feature"
                    )
            by_feature = {f: t for t in served.values() for f in t.features}
            if features is not None:
                missing = [f for f in features if f not in by_feature]
                if missing:
                    raise KeyError(
                        f"feature '{missing[0]}' is not served by {name} (it serves "
                        f"{sorted(by_feature)})"
                    )
            wanted = list(by_feature) if features is None else list(features)
            # Tables in the order of their first wanted feature (the server's order by
            # default); each table reads its wanted features in the order given.
            tables: dict[str, list[str]] = {}
            for feature in wanted:
                tables.setdefault(by_feature[feature].name, []).append(feature)
            configs = []
            for table, names in tables.items():
                info = served[table]
                try:
                    data_type = _data_type(info)
                except ValueError:
                    # Tables of raw bytes (int8 without a row-wise scale) cannot be pooled:
                    # left out by default, an error when asked for.
                    if features is None:
                        continue
                    raise
                if isinstance(pooling, dict):
                    table_pooling = pooling.get(table, PoolingType.SUM)
                else:
                    table_pooling = pooling
                configs.append(
                    EmbeddingBagConfig(
                        name=table,
                        embedding_dim=_pooled_dim(info),
                        num_embeddings=info.num_rows,
                        feature_names=names,
                        pooling=table_pooling,
                        data_type=data_type,
                    )
                )
            return cls(
                configs,
                client,
                name,
                served,
                is_weighted=is_weighted,
                allow_unknown_keys=allow_unknown_keys,
                owns_client=True,
            )
        except BaseException:
            client.close()
            raise

    def _check_served(self, allow_dtype_mismatch: bool, allow_table_name_mismatch: bool) -> None:
        by_feature = {f: t for t in self._served.values() for f in t.features}
        for config in self._embedding_bag_configs:
            for feature in config.feature_names:
                info = by_feature.get(feature)
                if info is None:
                    hint = ""
                    if config.name in self._served:
                        # The table is there under its own name only: packed from a state
                        # dict, which holds no feature names.
                        hint = (
                            f"; it serves table '{config.name}' without this feature: pack "
                            "with compress_model(model, pack_to=DIR), or `ibpembed pack ... "
                            f"--feature {feature}={config.name}`"
                        )
                    raise KeyError(
                        f"feature '{feature}' (table '{config.name}') is not served by "
                        f"{self._target} (it serves {sorted(by_feature)}){hint}"
                    )
                if _pooled_dim(info) != config.embedding_dim:
                    raise ValueError(
                        f"feature '{feature}' (table '{config.name}'): the config says dim "
                        f"{config.embedding_dim}, {self._target} serves it from table "
                        f"'{info.name}' with pooled dim {_pooled_dim(info)}"
                    )
                if info.num_rows != config.num_embeddings:
                    raise ValueError(
                        f"feature '{feature}' (table '{config.name}'): the config says "
                        f"{config.num_embeddings} rows, {self._target} serves it from table "
                        f"'{info.name}' with {info.num_rows} rows"
                    )
                rows = _SERVED_ROWS.get(config.data_type, ())
                if not allow_dtype_mismatch and _rows(info) not in rows:
                    raise ValueError(
                        f"feature '{feature}' (table '{config.name}'): the config says "
                        f"{config.data_type.value}, {self._target} serves it from table "
                        f"'{info.name}' holding {_rows(info)} rows (pass "
                        "allow_dtype_mismatch=True to pool those rows anyway)"
                    )
                if not allow_table_name_mismatch and info.name != config.name:
                    raise ValueError(
                        f"feature '{feature}' (table '{config.name}'): {self._target} serves it "
                        f"from table '{info.name}' (a --feature mapping that crosses tables? "
                        "pass allow_table_name_mismatch=True if the server holds this table "
                        "under another name)"
                    )

    # -- torchrec's interface --------------------------------------------------------------
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as torchrec's ``EmbeddingBagCollection.embedding_bag_configs()``."""
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        """Whether the KJT's weights scale the rows."""
        return self._is_weighted

    def table_report(self, module: str = "") -> list[TableReport]:
        """Bytes per table as the server reports them (raw rows vs what it stores)."""
        by_feature = {f: t for t in self._served.values() for f in t.features}
        report = []
        for config in self._embedding_bag_configs:
            info = by_feature[config.feature_names[0]]
            report.append(
                TableReport(
                    module,
                    config.name,
                    info.num_rows,
                    info.dim,
                    info.raw_bytes,
                    info.stored_bytes,
                )
            )
        return report

    # -- lookups ---------------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature on the server, in one request.

        Raises
        ------
        RemoteLookupError
            for a request the server refused (its message names the feature) or could not
            answer (unreachable, past the deadline), naming the target and the features.
        """
        self._check_open()
        request, stride, lengths = self._request(features)
        try:
            result = self._client.lookup_request(request)
        except LookupServiceError as err:
            raise self._error(err) from err
        return self._keyed(result, stride, lengths, features)

    def lookup_stream(self, batches: Iterable[KeyedJaggedTensor]) -> Iterator[KeyedTensor]:
        """``forward`` for many batches, pipelined on one ``LookupStream`` (results in order).

        The next requests are on the wire while earlier answers are decoded, which hides the
        round trip when batches are ready ahead of time. Over row-sharded servers (no stream
        across shards) the batches go one ``forward`` after another.
        """
        self._check_open()
        if not isinstance(self._client, LookupClient):
            for kjt in batches:
                yield self.forward(kjt)
            return
        # Filled by gRPC's thread as it sends each request, emptied here in the same order (the
        # stream answers in request order).
        pending: collections.deque[tuple[int, dict[str, torch.Tensor], KeyedJaggedTensor]] = (
            collections.deque()
        )

        def requests() -> Iterator[Any]:
            for kjt in batches:
                request, stride, lengths = self._request(kjt)
                pending.append((stride, lengths, kjt))
                yield request

        try:
            for result in self._client.lookup_stream(requests()):
                stride, lengths, kjt = pending.popleft()
                if result.error is not None:
                    raise self._error(result.error)
                yield self._keyed(result, stride, lengths, kjt)
        except LookupServiceError as err:
            raise self._error(err) from err

    def _request(self, features: KeyedJaggedTensor) -> tuple[Any, int, dict[str, torch.Tensor]]:
        """The batch as one request (checked first), its batch size, and lengths per feature."""
        keys = features.keys()
        known = set(self._features)
        if not self._allow_unknown_keys:
            for key in keys:
                if key not in known:
                    raise KeyError(
                        f"KJT key '{key}' is not read by any table; known: {self._features}"
                    )
        for feature in self._features:
            if feature not in keys:
                raise KeyError(f"feature '{feature}' is missing from the KJT (keys: {keys})")
        if features.variable_stride_per_key():
            raise NotImplementedError("variable-batch (VBE) KeyedJaggedTensors are not supported")
        values = features.values()
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"KJT values must be integer ids, got {values.dtype}")
        stride = features.stride()
        lengths = features.lengths()
        if lengths.dim() != 1:
            raise ValueError(
                f"KJT lengths must be 1-D (keys x batch), got shape {list(lengths.shape)}"
            )
        if lengths.numel() != len(keys) * stride:
            raise ValueError(
                f"KJT lengths has {lengths.numel()} entries, expected {len(keys)} keys x "
                f"batch {stride} = {len(keys) * stride}"
            )
        lengths_2d = lengths.to(torch.int64).cpu().reshape(len(keys), stride)
        per_key = lengths_2d.sum(1).tolist()
        if sum(per_key) != values.numel():
            raise ValueError(
                f"KJT lengths sum to {sum(per_key)} but there are {values.numel()} values"
            )
        weights = features.weights_or_none() if self._is_weighted else None
        if self._is_weighted and (weights is None or weights.numel() != values.numel()):
            got = "no weights" if weights is None else f"{weights.numel()} weights"
            raise ValueError(
                f"this collection is weighted: the KJT has {got} for {values.numel()} values"
            )
        # The request is host bytes: a KJT on a GPU is read back once.
        ids = values.to(torch.int64).cpu().numpy()
        w = None if weights is None else weights.to(torch.float32).cpu().numpy()
        starts = np.concatenate([[0], np.cumsum(per_key)])
        index = {k: i for i, k in enumerate(keys)}
        batches: dict[str, FeatureBatch] = {}
        per_feature_lengths: dict[str, torch.Tensor] = {}
        for feature in self._features:
            k = index[feature]
            a, b = int(starts[k]), int(starts[k + 1])
            bag_lengths = lengths_2d[k]
            per_feature_lengths[feature] = bag_lengths
            batches[feature] = FeatureBatch(
                ids[a:b], bag_lengths.numpy(), None if w is None else w[a:b]
            )
        try:
            request = build_request(batches, self._pooling)
        except (TypeError, ValueError) as err:
            raise type(err)(f"KJT: {err}") from None
        return request, stride, per_feature_lengths

    def _keyed(
        self,
        result: LookupResult,
        stride: int,
        lengths: dict[str, torch.Tensor],
        features: KeyedJaggedTensor,
    ) -> KeyedTensor:
        """The answer as the batch's ``KeyedTensor``, on the device of its ids."""
        out = torch.empty(stride, sum(self._dims), dtype=torch.float32)
        view = out.numpy()
        col = 0
        local_mean = self._pooling == "sum"
        for feature, dim, mean in zip(self._features, self._dims, self._mean, strict=True):
            pooled = result[feature]
            if pooled.shape != (stride, dim):
                raise RemoteLookupError(
                    f"feature '{feature}': {self._target} answered shape {pooled.shape}, "
                    f"expected {(stride, dim)}",
                    LookupServiceError(grpc.StatusCode.INTERNAL, "bad shape"),
                )
            np.copyto(view[:, col : col + dim], pooled)
            if mean and local_mean:
                # The server's MEAN: the fp32 sum times the rounded fp32 reciprocal of the bag
                # length (empty bags stay zero).
                n = lengths[feature].to(torch.float32).clamp(min=1.0)
                out[:, col : col + dim] *= (1.0 / n).unsqueeze(1)
            col += dim
        expanded = expand_inverse_indices(
            out, features.inverse_indices_or_none(), self._features, self._dims
        )
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._dims,
            values=expanded.to(features.values().device),
        )

    def _error(self, err: LookupServiceError) -> RemoteLookupError:
        if err.code in _UNREACHABLE:
            what = f"cannot reach ibpembed server {self._target}"
        else:
            what = f"ibpembed server {self._target} refused the lookup"
        return RemoteLookupError(f"{what} (features {self._features}): {err}", err)

    def close(self) -> None:
        """Release the connection: close it when this module opened it (:meth:`from_server`),
        or when this is the last open collection built over it by :func:`remote_collections`
        (``compress_model(model, remote=...)``). Lookups on a closed module raise
        ``RuntimeError``; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            self._shared.release()
        elif self._owns_client:
            self._client.close()

    def _check_open(self) -> None:
        # A closed client would open a new channel on the next call, which nothing closes.
        if self._closed:
            raise RuntimeError(f"this RemoteEmbeddingBagCollection ({self._target}) is closed")

    def __enter__(self) -> RemoteEmbeddingBagCollection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        return f"target={self._target}, features={self._features}"
