# SPDX-License-Identifier: Apache-2.0
"""What compression saved, per table: the report ``compress_model`` returns."""

from dataclasses import dataclass

from ibpembed import layout


@dataclass(frozen=True)
class TableReport:
    """Host bytes of one table before and after compression.

    Attributes
    ----------
    module : dotted path of the collection inside the model ("" for the model itself).
    table : table name in the collection.
    num_embeddings, embedding_dim : table shape.
    raw_bytes : bytes of the dense torchrec weight.
    stored_bytes : bytes of everything needed to decode (payload, index, bitmask, masks).
    hot_bytes : bytes of the decoded tier (``cache_hot_rows``), on top of ``stored_bytes``.
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
        return layout.savings(self.stored_bytes, self.raw_bytes)


def format_table_bytes(report: list[TableReport]) -> str:
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
