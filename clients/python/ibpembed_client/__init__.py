# SPDX-License-Identifier: Apache-2.0
"""Torch-free Python client for the ibpembed embedding-lookup service.

>>> from ibpembed_client import LookupClient
>>> with LookupClient("127.0.0.1:50051") as client:
...     pooled = client.lookup({"cat_0": [[1, 2], [3]]}, pooling="mean")["cat_0"]  # [2, D] fp32

Needs only grpcio, protobuf and numpy. :mod:`ibpembed_client.aio` has the asyncio client,
:mod:`ibpembed_client.shards` the clients over row-sharded servers (``ibpembed pack --shards``;
their map is :mod:`ibpembed_client.shard_map`),
:mod:`ibpembed_client.loadgen` the load generator (``ibpembed-loadgen``), and
:mod:`ibpembed_client.v1` the generated stubs (shared with the server).
"""

from importlib.metadata import PackageNotFoundError, version

from ibpembed_client._client import LookupClient
from ibpembed_client._errors import (
    OVERLOADED_METADATA_KEY,
    VERSIONS_HELD_METADATA_KEY,
    LookupServiceError,
)
from ibpembed_client._options import (
    KeepAliveOptions,
    OutlierEjection,
    RetryPolicy,
    TlsOptions,
    service_config,
)
from ibpembed_client._request import FeatureBatch, Router, build_request
from ibpembed_client._result import LookupResult, TableInfo, bf16_to_float32, decode_response
from ibpembed_client.aio import AsyncLookupClient
from ibpembed_client.regions import OutputRegion, SharedMemoryRegion
from ibpembed_client.shard_map import ShardedTable, ShardMap, ShardRange
from ibpembed_client.shards import AsyncShardedLookupClient, ShardedLookupClient

__all__ = [
    "OVERLOADED_METADATA_KEY",
    "VERSIONS_HELD_METADATA_KEY",
    "AsyncLookupClient",
    "AsyncShardedLookupClient",
    "FeatureBatch",
    "KeepAliveOptions",
    "LookupClient",
    "LookupResult",
    "LookupServiceError",
    "OutlierEjection",
    "OutputRegion",
    "RetryPolicy",
    "Router",
    "ShardMap",
    "ShardRange",
    "ShardedLookupClient",
    "ShardedTable",
    "SharedMemoryRegion",
    "TableInfo",
    "TlsOptions",
    "bf16_to_float32",
    "build_request",
    "decode_response",
    "service_config",
]
try:  # one source: clients/python/VERSION, read by both packages' builds
    __version__ = version("ibpembed-client")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "unknown"
