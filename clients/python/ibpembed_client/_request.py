# SPDX-License-Identifier: Apache-2.0
"""Building a ``LookupRequest``: per-feature id batches, checked, as little-endian bytes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Union

import numpy as np

from ibpembed_client.regions import OutputRegion
from ibpembed_client.v1 import lookup_pb2 as pb

Pooling = Literal["sum", "mean", "none"]
OutputDType = Literal["float32", "float16", "bfloat16"]
OUTPUT_DTYPES: dict[str, pb.DType] = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
}
POOLING: dict[str, pb.Pooling] = {
    "sum": pb.POOLING_SUM,
    "mean": pb.POOLING_MEAN,
    "none": pb.POOLING_NONE,
}

# A routing hook: picks the server ("host:port") for a whole lookup request (e.g. by table, or
# one of several replicas); None sends everything to the client's target. Tables sharded by row
# range need each request split across servers: ibpembed_client.shards does that.
Router = Callable[[pb.LookupRequest], str]


@dataclass(frozen=True)
class FeatureBatch:
    """One feature's jagged ids for B samples (one key of a KeyedJaggedTensor).

    Parameters
    ----------
    ids : [nnz] int64 row ids, samples back to back.
    lengths : [B] int32 ids per sample.
    weights : optional [nnz] float32 per-id weights.
    """

    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def from_lists(
        cls,
        samples: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]] | None = None,
    ) -> FeatureBatch:
        """From per-sample id lists: ``[[3, 1], [], [7]]`` is B=3 with lengths ``[2, 0, 1]``.

        ``weights``, when given, holds one list per sample with one weight per id.

        Raises
        ------
        TypeError
            when an id is not an integer (``1.5`` would otherwise be read as row 1).
        ValueError
            when ``weights`` does not match ``samples`` sample by sample.
        """
        lengths = np.array([len(s) for s in samples], dtype=np.int32)
        nnz = int(lengths.sum())
        flat = [i for s in samples for i in s]
        # numpy picks the type the values need, so a float, bool or oversized id shows up as a
        # non-int64 array instead of being cast to a row number.
        ids = np.array(flat) if flat else np.empty(0, dtype=np.int64)
        if ids.dtype.kind not in "iu":
            for i in flat:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                    raise TypeError(f"ids must be integers, got {i!r} ({type(i).__name__})")
            raise ValueError(f"ids must fit int64, got values in [{min(flat)}, {max(flat)}]")
        w = None
        if weights is not None:
            # Flattened, a weight list that is short in one sample and long in another would
            # still match the total and silently weight the wrong ids.
            if len(weights) != len(samples):
                raise ValueError(f"{len(weights)} weight lists for {len(samples)} samples")
            for i, (s, ws) in enumerate(zip(samples, weights, strict=True)):
                if len(ws) != len(s):
                    raise ValueError(f"sample {i} has {len(s)} ids but {len(ws)} weights")
            w = np.fromiter((x for s in weights for x in s), dtype=np.float32, count=nnz)
        return cls(ids, lengths, w)


FeatureInput = Union[FeatureBatch, Sequence[Sequence[int]]]  # noqa: UP007 (runtime alias on 3.10)


def _le_bytes(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _int_bytes(array: np.ndarray, dtype: str, what: str) -> bytes:
    """``array`` as little-endian ``dtype`` bytes, refusing values a cast would change."""
    array = np.asarray(array)
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.dtype == dtype:  # already the wire's type: nothing a cast could change
        return array.tobytes()
    # A cast would truncate 1.9 to 1 and look up the wrong row; an empty list is float64 in
    # numpy but holds nothing to truncate.
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {array.dtype}")
    # ... and a narrowing cast would wrap 2**40 to 0 (lengths are int32 on the wire).
    limits = np.iinfo(np.dtype(dtype))
    if array.size and (int(array.min()) < limits.min or int(array.max()) > limits.max):
        raise ValueError(
            f"{what} must fit {np.dtype(dtype).name}, got values in "
            f"[{int(array.min())}, {int(array.max())}]"
        )
    return _le_bytes(array, dtype)


def new_request_id() -> str:
    """A fresh request id, in the form the server picks for a request sent without one."""
    return uuid.uuid4().hex


def with_request_id(request: pb.LookupRequest) -> pb.LookupRequest:
    """``request``, or a copy of it with a fresh id when it has none.

    The clients send every request with an id, so that a failure's
    :attr:`LookupServiceError.request_id` is the id the server logged (the server would
    otherwise pick one the client never learns). A copy, not the caller's message: a request
    sent again would repeat this call's id. (Copying costs well under serializing it.)
    """
    if request.request_id:
        return request
    named = pb.LookupRequest()
    named.CopyFrom(request)
    named.request_id = new_request_id()
    return named


def build_request(
    features: Mapping[str, FeatureInput],
    pooling: Pooling = "sum",
    request_id: str = "",
    table_version: int = 0,
    *,
    output_dtype: OutputDType | None = None,
    output_region: OutputRegion | str | None = None,
) -> pb.LookupRequest:
    """A ``LookupRequest`` from per-feature batches or per-sample id lists.

    Parameters
    ----------
    features : feature name -> :class:`FeatureBatch` or list of per-sample id lists.
    pooling : ``"sum"``, ``"mean"`` or ``"none"`` (rows, bit-exact).
    request_id : echoed back and logged by the server on failures; empty = the client that
        sends the request picks a fresh one per call (:func:`with_request_id`).
    table_version : the table-set version to be served from (FAILED_PRECONDITION when the
        server does not hold it); 0 = the newest it holds.
    output_dtype : ``"float32"``, ``"float16"`` or ``"bfloat16"`` pooled outputs (the server
        rounds its fp32 sums once, to nearest even); None = float32. Not with ``"none"``.
    output_region : a registered region (its name, or an :class:`OutputRegion` window of it)
        for the server to write the values into instead of the response.

    Raises
    ------
    TypeError
        for ids or lengths that are not integers.
    ValueError
        for ids or lengths that are not 1-D, or an unknown pooling.
    """
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {sorted(POOLING)}, got {pooling!r}")
    request = pb.LookupRequest(
        request_id=request_id, pooling=POOLING[pooling], table_version=table_version
    )
    if output_dtype is not None:
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype must be one of {sorted(OUTPUT_DTYPES)}, got {output_dtype!r}"
            )
        request.output_dtype = OUTPUT_DTYPES[output_dtype]
    if output_region is not None:
        window = OutputRegion(output_region) if isinstance(output_region, str) else output_region
        request.output_region.name = window.name
        request.output_region.offset = window.offset
        request.output_region.byte_size = window.byte_size
    add = request.features.add  # in place: append() would copy each message
    for name, value in features.items():
        try:
            batch = value if isinstance(value, FeatureBatch) else FeatureBatch.from_lists(value)
        except (TypeError, ValueError) as err:
            raise type(err)(f"feature {name!r}: {err}") from None
        add(
            name=name,
            ids=_int_bytes(batch.ids, "<i8", f"feature {name!r}: ids"),
            lengths=_int_bytes(batch.lengths, "<i4", f"feature {name!r}: lengths"),
            weights=b"" if batch.weights is None else _le_bytes(batch.weights, "<f4"),
        )
    return request
