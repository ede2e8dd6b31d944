# SPDX-License-Identifier: Apache-2.0
"""The gRPC servicer: translation between ``ibpembed.v1`` messages and the LookupEngine, only.

Errors are raised, not returned: the interceptor maps them to statuses for unary RPCs, and
LookupStream turns each failed request into an ``Error`` message through the same map
(:func:`ibpembed.server.status.status_for`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import torch

from ibpembed.engine import (
    AdmissionSlot,
    FeatureQuery,
    LookupEngine,
    LookupResult,
    Pooling,
    TableDescription,
)
from ibpembed.errors import InvalidArgument
from ibpembed.server.status import (
    MAX_REQUEST_ID_CHARS,
    UndecodableRequest,
    ensure_request_id,
    status_for,
)
from ibpembed.server.wire import lookup_response_bytes, serialize_response
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc

log = logging.getLogger(__name__)

_POOLING: dict[int, Pooling] = {
    pb.POOLING_UNSPECIFIED: "sum",
    pb.POOLING_SUM: "sum",
    pb.POOLING_MEAN: "mean",
    pb.POOLING_NONE: "none",
}
_DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.uint8: pb.DTYPE_UINT8,
    torch.int8: pb.DTYPE_INT8,
    torch.int32: pb.DTYPE_INT32,
    torch.int64: pb.DTYPE_INT64,
}


def _array(data: bytes, dtype: str, field: str) -> np.ndarray:
    """A read-only little-endian view of ``data``; the byte count must fit the element size."""
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise InvalidArgument(
            field, f"{len(data)} bytes is not a whole number of {itemsize}-byte {dtype} values"
        )
    return np.frombuffer(data, dtype=dtype)


def decode_request(request: pb.LookupRequest) -> tuple[list[FeatureQuery], Pooling]:
    """Features and pooling of a request; :class:`InvalidArgument` for undecodable fields."""
    if isinstance(request, UndecodableRequest):  # a LookupStream message that did not parse
        raise request.error()
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # echoed in the response and the logs
        raise InvalidArgument(
            "request_id", f"{len(request.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}"
        )
    if request.pooling not in _POOLING:
        raise InvalidArgument("pooling", f"unknown value {request.pooling}")
    features = []
    for i, feature in enumerate(request.features):
        if not feature.name:
            raise InvalidArgument(f"features[{i}].name", "empty feature name")
        weights = None
        if feature.weights:
            weights = _array(feature.weights, "<f4", f"features[{i}].weights")
        features.append(
            FeatureQuery(
                name=feature.name,
                ids=_array(feature.ids, "<i8", f"features[{i}].ids"),
                lengths=_array(feature.lengths, "<i4", f"features[{i}].lengths"),
                weights=weights,
            )
        )
    return features, _POOLING[request.pooling]


def encode_response(request_id: str, result: LookupResult) -> bytes:
    """The serialized ``LookupResponse`` (:mod:`ibpembed.server.wire`: raw little-endian values
    per feature, one memory copy)."""
    features = [(f.name, _DTYPES[f.values.dtype], f.values) for f in result.features]
    return lookup_response_bytes(request_id, result.version, features)


def table_info(desc: TableDescription) -> pb.TableInfo:
    return pb.TableInfo(
        name=desc.name,
        num_rows=desc.num_rows,
        dim=desc.dim,
        dtype=_DTYPES[desc.dtype],
        quant=desc.quant or "",
        raw_bytes=desc.raw_bytes,
        stored_bytes=desc.stored_bytes,
        chunk_bits=desc.chunk_bits,
        version=desc.version,
        row_start=desc.row_start,
        row_end=desc.row_end,
        features=list(desc.features),
    )


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The RPC deadline on the ``time.monotonic()`` clock, or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


# A LookupStream request's task: its response, and the admission slot the writer releases.
_Answer = asyncio.Future[tuple[bytes | pb.LookupResponse, AdmissionSlot | None]]


async def _answer(item: _Answer) -> tuple[bytes | pb.LookupResponse, AdmissionSlot | None]:
    """A LookupStream request's answer, awaited by the writer.

    NOTE(server): a cancel of the writer (client gone, deadline) that lands in the loop turn in
    which ``item`` finishes raises CancelledError here and drops its result: asyncio's Task
    cancels on its next wakeup even when the future it awaited is done. The answer's slot is
    then released here, or no one would (the item has left the queue): one leaked slot per such
    race, until max_inflight of them refuse every request.
    """
    try:
        return await item
    except BaseException:
        _drop(item)
        raise


def _drop(item: _Answer) -> None:
    """Discard a LookupStream answer that will never be written: release the slot it holds, or
    cancel it if it is still running (``_stream_one`` then releases what it holds)."""
    if not item.done():
        item.cancel()
    elif not item.cancelled() and item.exception() is None:
        _, slot = item.result()
        if slot is not None:
            slot.release()


class EmbeddingLookupServicer(lookup_pb2_grpc.EmbeddingLookupServicer):
    """``ibpembed.v1.EmbeddingLookup`` over a :class:`LookupEngine`.

    Parameters
    ----------
    engine : does the lookups (None until the tables are loaded).
    stream_window : requests of one LookupStream in the engine or waiting to be written at
        once; the stream stops reading (gRPC flow control pushes back on the client) while the
        window is full.

    A LookupStream request keeps its engine admission slot until its response is written, not
    just until its kernels finish: a client that stops reading leaves computed responses waiting
    in the stream on HTTP/2 flow control, and they count against ``max_inflight`` like running
    work, so the memory such streams hold is bounded (``max_inflight`` responses in all) and the
    overload shows as RESOURCE_EXHAUSTED and in the in-flight gauge. A unary response leaves
    admission when its kernels finish and waits in gRPC's buffers, one per call a client keeps
    open: holding the slot until the call's end cost 15 % of the answered requests of a
    saturated server (RELIABILITY.md, *Defects* 31).
    """

    def __init__(self, engine: LookupEngine | None, *, stream_window: int = 8) -> None:
        # None while the server loads its tables: the interceptor's gate answers every RPC
        # UNAVAILABLE until the server sets it.
        self.engine = engine
        self.stream_window = stream_window

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> bytes:
        features, pooling = decode_request(request)
        return await self.engine.lookup(
            features,
            pooling,
            deadline=deadline_of(context),
            then=functools.partial(encode_response, request.request_id),
            table_version=request.table_version,
        )

    async def LookupStream(
        self, request_iterator: AsyncIterator[pb.LookupRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.LookupResponse]:
        deadline = deadline_of(context)
        # Reader task -> queue of per-request tasks -> this generator, which yields them in order.
        # A queue item is a task, None (client done) or the reader's exception. A request holds
        # one of stream_window places from when it is read until its response is written, so at
        # most stream_window requests are running or waiting to be written.
        queue: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(self.stream_window)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    await queue.put(asyncio.ensure_future(self._stream_one(request, deadline)))
            except Exception as exc:  # handed to the writer, which raises it as the stream status
                await queue.put(exc)
            else:
                await queue.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                response, slot = await _answer(item)
                try:
                    yield response  # resumes once gRPC has taken the message (flow control)
                finally:
                    if slot is not None:
                        slot.release()
                    window.release()
        finally:
            reader.cancel()
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, asyncio.Future):
                    _drop(item)

    async def _stream_one(
        self, request: pb.LookupRequest, deadline: float | None
    ) -> tuple[bytes | pb.LookupResponse, AdmissionSlot | None]:
        """One stream request's response, and the admission slot the writer releases once the
        response is written (None for an error reply, which holds nothing)."""
        ensure_request_id(request)
        slot = None
        try:
            features, pooling = decode_request(request)
            slot = self.engine.admit()
            response = await self.engine.lookup(
                features,
                pooling,
                deadline=deadline,
                then=functools.partial(encode_response, request.request_id),
                slot=slot,
                table_version=request.table_version,
            )
            return response, slot
        except Exception as exc:
            if slot is not None:
                slot.release()
            code, message = status_for(exc, request.request_id)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("LookupStream request %s failed", request.request_id)
            error = pb.Error(code=code.value[0], message=message)
            return pb.LookupResponse(request_id=request.request_id, error=error), None
        except BaseException:  # cancelled: the stream ended before this response was written
            if slot is not None:
                slot.release()
            raise

    async def ListTables(
        self, request: pb.ListTablesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListTablesResponse:
        tables = [table_info(d) for d in self.engine.describe()]
        held = self.engine.store.versions_held()
        return pb.ListTablesResponse(tables=tables, table_version=held[-1], versions_held=held)

    async def DescribeTable(
        self, request: pb.DescribeTableRequest, context: grpc.aio.ServicerContext
    ) -> pb.TableInfo:
        return table_info(self.engine.describe(request.name)[0])


class _GeneratedHandlers:
    """Stands in for a server to collect what the generated registration adds."""

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_to_server(servicer: EmbeddingLookupServicer, server: grpc.aio.Server) -> None:
    """Register ``ibpembed.v1.EmbeddingLookup`` as the generated
    ``add_EmbeddingLookupServicer_to_server`` does, except that the lookups answer with the bytes
    of :func:`encode_response`, which their serializer passes through."""
    generated = _GeneratedHandlers()
    lookup_pb2_grpc.add_EmbeddingLookupServicer_to_server(servicer, generated)
    handlers = {
        name: handler._replace(response_serializer=serialize_response)
        if name in ("Lookup", "LookupStream")
        else handler
        for name, handler in generated.handlers.items()
    }
    generic = grpc.method_handlers_generic_handler(generated.service, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(generated.service, handlers)
