# SPDX-License-Identifier: Apache-2.0
"""Swapping a model's torchrec ``EmbeddingBagCollection``s for compressed ones, in place."""

from typing import Any

from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ibpembed.torchrec.collection import CompressedEmbeddingBagCollection
from ibpembed.torchrec.report import TableReport


def compress_model(
    model: nn.Module, allow_unknown_keys: bool = False, **compress_kwargs: Any
) -> list[TableReport]:
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
    report: list[TableReport] = []
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
