# SPDX-License-Identifier: Apache-2.0
"""In-process torchrec integration: compressed drop-in ``EmbeddingBagCollection``.

>>> report = compress_model(model)          # swaps every EmbeddingBagCollection in place
>>> print(format_table_bytes(report))       # host bytes before / after per table

Needs ``torchrec`` (and the ``fbgemm-gpu-cpu`` it imports); see docs/torchrec.md.
"""

from ibpembed.torchrec.module import (
    CompressedEmbeddingBag,
    CompressedEmbeddingBagCollection,
    TableBytes,
    compress_model,
    format_table_bytes,
    pooled_error_bound,
)

__all__ = [
    "CompressedEmbeddingBag",
    "CompressedEmbeddingBagCollection",
    "TableBytes",
    "compress_model",
    "format_table_bytes",
    "pooled_error_bound",
]
