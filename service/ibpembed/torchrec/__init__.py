# SPDX-License-Identifier: Apache-2.0
"""torchrec integration: compressed drop-in ``EmbeddingBagCollection``s, in process or remote.

>>> report = compress_model(model)          # swaps every EmbeddingBagCollection in place
>>> print(format_table_bytes(report))       # host bytes before / after per table
>>> ebc = RemoteEmbeddingBagCollection.from_server("127.0.0.1:50051")  # tables on a server

Needs ``torchrec`` (and the ``fbgemm-gpu-cpu`` it imports); see docs/torchrec.md. The remote
collection needs the ``ibpembed-client`` package too; it is imported on first use, so importing
this package never pulls in grpc.

Modules: ``bag`` (one compressed table), ``collection`` (the collection), ``convert``
(``compress_model``), ``report`` (bytes saved), ``accuracy`` (the pooled-output bound),
``remote`` (the collection served by ``ibpembed serve``).
"""

from typing import Any

from ibpembed.torchrec.accuracy import pooled_error_bound
from ibpembed.torchrec.bag import CompressedEmbeddingBag
from ibpembed.torchrec.collection import CompressedEmbeddingBagCollection
from ibpembed.torchrec.convert import compress_model
from ibpembed.torchrec.report import TableReport, format_table_bytes

__all__ = [
    "CompressedEmbeddingBag",
    "CompressedEmbeddingBagCollection",
    "RemoteEmbeddingBagCollection",
    "TableReport",
    "compress_model",
    "format_table_bytes",
    "pooled_error_bound",
]


def __getattr__(name: str) -> Any:
    # The remote collection imports the gRPC client: loaded only when asked for.
    if name == "RemoteEmbeddingBagCollection":
        from ibpembed.torchrec.remote import RemoteEmbeddingBagCollection

        return RemoteEmbeddingBagCollection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
