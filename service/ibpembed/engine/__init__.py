# SPDX-License-Identifier: Apache-2.0
"""LookupEngine: the transport-neutral core of the lookup service.

A request is a set of features, each a jagged batch of ids (one key of a KeyedJaggedTensor)::

    feature f, batch B:  lengths[B] (ids per sample), ids[nnz] (samples back to back),
                         weights[nnz] optional (per-id weights)
    pooling "none":      out[f] = table[ids]                       [nnz, D]  table dtype, bit-exact
    pooling "sum":       out[f][b] = sum_j w[j] * table[ids[j]]    [B, D]    fp32, j in sample b
    pooling "mean":      out[f][b] = out_sum[f][b] / lengths[b]     (zeros for empty samples)

Ids are global row numbers. A server holding a row shard of a table (a table set packed with
``ibpembed pack --shards``) holds global rows ``[row_start, row_end)`` of it: it accepts ids in
that range only (others are INVALID_ARGUMENT naming the range) and subtracts ``row_start``
before the kernels, so clients route ids without renumbering them.

The engine validates the request, groups features by table (each table's features form one
batch, whatever their number), and runs the kernels: on the CPU, pooled lookups of every table
of the request in one call of the fused kernel (``CompressedTableSet``; a table with very many
ids deduplicates them first instead), otherwise one call per table. Calls run in a thread pool
so the asyncio event loop never waits on them (torch ops run their C++ without holding the GIL,
so the pool's threads decode in parallel). It holds a bounded number of requests: past
``max_inflight`` new ones fail at once with :class:`~ibpembed.errors.Overloaded` instead
of queueing.

The package, one job a module: ``requests`` (what a lookup takes and gives, and its
:class:`LookupOptions`), ``planning`` (a request checked and grouped into per-table work),
``execution`` (the kernel calls), ``cuda`` (the GPU's device choice, streams and copies back),
``sketch`` (a frequency sketch), ``tier`` (which rows the CPU keeps decoded; how many:
:mod:`ibpembed.tables.tier_budget`) and ``core`` (:class:`LookupEngine`: admission, worker
threads, snapshots).
"""

from ibpembed.engine.core import AdmissionSlot, LookupEngine
from ibpembed.engine.cuda import MIN_CUDA_CAPABILITY, cuda_kernels_present, resolve_device
from ibpembed.engine.requests import (
    OUTPUT_DTYPES,
    POOLINGS,
    FeatureQuery,
    FeatureResult,
    KernelCall,
    LookupObserver,
    LookupOptions,
    LookupResult,
    PackedRequest,
    Pooling,
    Request,
    TableDescription,
)
from ibpembed.engine_defaults import DEDUPE_MIN_IDS, INLINE_MAX_IDS
from ibpembed.tables.tier_budget import TierBudget

__all__ = [
    "DEDUPE_MIN_IDS",
    "INLINE_MAX_IDS",
    "MIN_CUDA_CAPABILITY",
    "OUTPUT_DTYPES",
    "POOLINGS",
    "AdmissionSlot",
    "FeatureQuery",
    "FeatureResult",
    "KernelCall",
    "LookupEngine",
    "LookupObserver",
    "LookupOptions",
    "LookupResult",
    "PackedRequest",
    "Pooling",
    "Request",
    "TableDescription",
    "TierBudget",
    "cuda_kernels_present",
    "resolve_device",
]
