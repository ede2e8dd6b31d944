# SPDX-License-Identifier: Apache-2.0
"""Swapping a model's torchrec ``EmbeddingBagCollection``s for compressed or remote ones, or
packing their tables for a server."""

import os
from collections.abc import Sequence
from typing import Any

from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ibpembed.torchrec.collection import CompressedEmbeddingBagCollection
from ibpembed.torchrec.report import TableReport


def compress_model(
    model: nn.Module,
    allow_unknown_keys: bool = False,
    *,
    remote: str | Sequence[str] | None = None,
    client_options: dict[str, Any] | None = None,
    allow_dtype_mismatch: bool = False,
    allow_table_name_mismatch: bool = False,
    pack_to: str | os.PathLike[str] | None = None,
    **compress_kwargs: Any,
) -> list[TableReport]:
    """Replace every torchrec ``EmbeddingBagCollection`` inside ``model``, in place (or, with
    ``pack_to``, pack their tables for a server and leave the model as it is).

    Parameters
    ----------
    model : any module holding float ``EmbeddingBagCollection`` submodules (quantized and sharded
        collections are different classes and are left alone).
    allow_unknown_keys : passed to each new collection; set it when one KJT carrying features
        for several collections is fed to each of them. Not with ``pack_to``.
    remote : None compresses the tables into the model (``CompressedEmbeddingBagCollection``).
        A server address (or every shard's address) makes each collection a
        ``RemoteEmbeddingBagCollection`` on that server instead, with the collection's own
        configs (each table's data type that of its weights, which torchrec pools), checked
        against what the server serves: features, the tables serving them, dims, rows and
        dtype (pack the model's tables with ``compress_model(model, pack_to=DIR)`` first).
        All collections share one connection, closed once every one of them has been closed
        (``close()``).
    client_options : for ``remote`` only: :class:`~ibpembed_client.LookupClient` options.
    allow_dtype_mismatch : for ``remote``: accept served tables whose rows are not the
        weights' dtype (e.g. int8_rowwise rows for an fp32 model); the outputs are then those
        rows' pooling.
    allow_table_name_mismatch : for ``remote``: accept a feature served from a table of
        another name than the config's (tables packed under other names, their features mapped
        with ``ibpembed pack --feature``); dims, rows and dtype are still checked.
    pack_to : a table-set directory: pack every collection's tables into it (publishing its
        next version, as ``ibpembed pack`` does) with their torchrec feature names, which a
        state dict does not hold, so that ``ibpembed serve --tables DIR`` serves what
        ``remote`` then checks; the model is not changed. Not with ``remote``.
    **compress_kwargs : passed to :func:`ibpembed.compress` (in-process), or to
        :func:`ibpembed.tables.pack.pack_table_set` (``pack_to``: ``sample_rows``, ``seed``,
        ``method``, ``merge``...).

    Returns
    -------
    Bytes per table before and after, in module order (see :func:`format_table_bytes`); for
    ``remote``, as the server reports them; for ``pack_to``, as packed. A collection
    registered under several paths is replaced at each by one new module and reported once,
    under its first path.

    Raises
    ------
    TypeError
        If ``model`` is itself an ``EmbeddingBagCollection`` (there is no parent to swap it in:
        use ``CompressedEmbeddingBagCollection.from_ebc``), or for an option that would do
        nothing: ``client_options``, ``allow_dtype_mismatch`` or
        ``allow_table_name_mismatch`` without ``remote``,
        ``allow_unknown_keys`` or ``client_options`` with ``pack_to``.
    ValueError
        If ``model`` holds no ``EmbeddingBagCollection``; for ``remote``, a feature served
        from another table, or a table whose dim, rows or dtype differ from the server's
        (naming the feature and table).
    KeyError
        For ``remote``, a feature the server does not serve.

    On any error the model is left as it was (every replacement is built before the first is
    swapped in) and a connection opened for ``remote`` is closed.
    """
    if pack_to is not None and remote is not None:
        raise TypeError(
            "pack_to and remote: pack first, serve the directory, then call "
            "compress_model(model, remote=...)"
        )
    if remote is None:
        for name, given in (
            ("client_options", client_options is not None),
            ("allow_dtype_mismatch", allow_dtype_mismatch),
            ("allow_table_name_mismatch", allow_table_name_mismatch),
        ):
            if given:
                raise TypeError(f"{name} applies to remote collections only")
    if pack_to is not None:
        if allow_unknown_keys:
            raise TypeError("allow_unknown_keys does not apply to pack_to: no module is built")
        return _pack(model, pack_to, compress_kwargs)
    if isinstance(model, EmbeddingBagCollection):
        raise TypeError(
            "model is itself an EmbeddingBagCollection: use "
            "CompressedEmbeddingBagCollection.from_ebc(model)"
        )
    if remote is not None and compress_kwargs:
        raise TypeError(f"compression options {sorted(compress_kwargs)} do not apply to remote")
    # Collected first: swapping while named_modules() walks the tree would skip siblings. Every
    # path: a collection registered under several (shared) is replaced at each, by one module.
    targets = [
        (path, m)
        for path, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, EmbeddingBagCollection)
    ]
    if not targets:
        raise ValueError(f"{type(model).__name__} holds no torchrec EmbeddingBagCollection")
    # One replacement per collection, however many paths hold it (reported once, under its
    # first path: its tables are stored once).
    first_paths: dict[int, tuple[str, EmbeddingBagCollection]] = {}
    for path, ebc in targets:
        first_paths.setdefault(id(ebc), (path, ebc))
    sources = list(first_paths.values())
    # Every replacement is built before any is swapped in, so a collection that cannot be
    # converted leaves the model as it was.
    report: list[TableReport] = []
    replacements: dict[int, nn.Module] = {}
    if remote is None:
        for path, ebc in sources:
            compressed = CompressedEmbeddingBagCollection.from_ebc(
                ebc, allow_unknown_keys=allow_unknown_keys, **compress_kwargs
            )
            replacements[id(ebc)] = compressed
            report.extend(compressed.table_bytes(path))
    else:
        # Imported here: the remote module pulls in grpc, which in-process users never need.
        from ibpembed.torchrec.remote import remote_collections

        remotes = remote_collections(
            [ebc for _, ebc in sources],
            remote,
            allow_unknown_keys=allow_unknown_keys,
            allow_dtype_mismatch=allow_dtype_mismatch,
            allow_table_name_mismatch=allow_table_name_mismatch,
            **(client_options or {}),
        )
        for (path, ebc), twin in zip(sources, remotes, strict=True):
            replacements[id(ebc)] = twin
            report.extend(twin.table_report(path))
    for path, ebc in targets:
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, replacements[id(ebc)])
    return report


def _pack(
    model: nn.Module, directory: str | os.PathLike[str], pack_kwargs: dict[str, Any]
) -> list[TableReport]:
    # Imported here: packing pulls in the table writers, which swapping never needs.
    from ibpembed.tables.importers import from_torchrec
    from ibpembed.tables.pack import pack_table_set

    paths = {
        config.name: path
        for path, m in model.named_modules()
        if isinstance(m, EmbeddingBagCollection)
        for config in m.embedding_bag_configs()
    }
    packed = pack_table_set(directory, from_torchrec(model), **pack_kwargs)
    return [
        TableReport(paths.get(p.name, ""), p.name, p.num_rows, p.dim, p.raw_bytes, p.stored_bytes)
        for p in packed
    ]
