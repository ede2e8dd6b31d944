# SPDX-License-Identifier: Apache-2.0
"""The gRPC servicer: ``ibpembed.v1`` RPCs translated to LookupEngine calls, only (messages are
decoded and encoded by :mod:`ibpembed.server.wire`).

Errors are raised, not returned: the interceptor maps them to statuses for unary RPCs, and
LookupStream turns each failed request into an ``Error`` message through the same map
(:func:`ibpembed.server.status.status_for`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Protocol, cast

import grpc

from ibpembed.engine import LookupEngine, LookupOptions, LookupResult, Request
from ibpembed.errors import (
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
    Unimplemented,
    VersionNotHeld,
)
from ibpembed.server.backlog import StreamBacklog
from ibpembed.server.identity import CallerIdentities
from ibpembed.server.regions import NONCE_TTL_S, Region, RegionRegistry
from ibpembed.server.status import ensure_request_id, status_for
from ibpembed.server.wire import (
    REGION_KINDS,
    REGION_VALUE_FIELDS,
    OutputWindow,
    check_request,
    decode_features,
    decode_region_inputs,
    encode_response,
    output_dtype_of,
    region_info,
    region_values_invalid,
    serialize_response,
    table_info,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc

log = logging.getLogger(__name__)


class OutputObserver(Protocol):
    """Optional metrics hook: where lookup outputs went, and the time a lookup request spent
    being decoded and encoded (worker threads or the event loop)."""

    def output_written(self, transport: str, nbytes: int) -> None:
        """One request's output: ``"wire"``, the response's bytes (values and their framing), or
        ``"shm"``, the value bytes written into its output region."""

    def wire_timed(self, phase: str, seconds: float) -> None:
        """One request's ``"decode"`` (its checks, and the message or input region into engine
        inputs) or ``"encode"`` (the result into response bytes, or into its output region)."""


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The RPC deadline on the ``time.monotonic()`` clock, or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class EmbeddingLookupServicer(lookup_pb2_grpc.EmbeddingLookupServicer):
    """``ibpembed.v1.EmbeddingLookup`` over a :class:`LookupEngine`.

    Parameters
    ----------
    engine : does the lookups (None until the tables are loaded).
    stream_window : requests of one LookupStream in the engine or waiting to be written at
        once; the stream stops reading (gRPC flow control pushes back on the client) while the
        window is full.
    regions : the shared-memory regions callers registered.
    identities : who a call is (:mod:`ibpembed.server.identity`): owns its regions.
    backlog : places for LookupStream requests read and not yet answered, per caller and in
        all (:mod:`ibpembed.server.backlog`).
    observer : optional metrics hook for where outputs went.
    max_input_bytes : the most bytes a request's ``input_region`` inputs may take (the server's
        message limit); None = only the region bounds them.

    A LookupStream request, like a unary one, leaves engine admission when its kernels finish;
    until its response is written it holds a place of the stream backlog instead. A client that
    stops reading so leaves computed responses waiting in the server on HTTP/2 flow control
    without taking capacity from anyone else's lookups, the memory they hold stays bounded by
    the backlog, and one caller's stalled streams take at most its share of it.
    """

    def __init__(
        self,
        engine: LookupEngine | None,
        *,
        stream_window: int = 8,
        regions: RegionRegistry | None = None,
        identities: CallerIdentities | None = None,
        backlog: StreamBacklog | None = None,
        observer: OutputObserver | None = None,
        max_input_bytes: int | None = None,
    ) -> None:
        # None while the server loads its tables: the interceptor's gate answers every RPC
        # UNAVAILABLE until the server sets it.
        self.engine = engine
        self.stream_window = stream_window
        self.regions = RegionRegistry() if regions is None else regions
        self.identities = CallerIdentities() if identities is None else identities
        # Default: the server's, for the default --max-inflight of 64.
        if backlog is None:
            backlog = StreamBacklog.for_server(64, stream_window)
        self.backlog = backlog
        # (versions held, withdrawn features) -> features served
        self._served: tuple[tuple[tuple[int, ...], int], int] = (((), 0), 0)
        self.observer = observer
        self.max_input_bytes = max_input_bytes

    @property
    def _engine(self) -> LookupEngine:
        """The engine, for an RPC: the interceptor's gate turns every RPC away until the server
        sets it, so this refuses one only on a servicer served without that gate."""
        if self.engine is None:
            raise Unavailable("server not accepting requests: the tables are still loading")
        return self.engine

    def caller_of(self, context: grpc.aio.ServicerContext) -> str:
        """Who owns the regions a call registers (:mod:`ibpembed.server.identity`)."""
        return self.identities.of(context.invocation_metadata())

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self._lookup(request, context, deadline_of(context))

    async def _lookup(
        self,
        request: pb.LookupRequest,
        context: grpc.aio.ServicerContext,
        deadline: float | None,
    ) -> bytes:
        """One request's response bytes: decoded, looked up and encoded (into the response, or
        its values into the output region)."""
        observer = self.observer
        started = time.perf_counter() if observer is not None else 0.0
        check_request(request)
        names = self._check_features(request)
        output_dtype = output_dtype_of(request)
        uses: list[Region] = []  # regions this request reads or writes, released when it ends
        features: Request
        try:
            if request.HasField("input_region"):
                caller = self.caller_of(context)
                region = self.regions.get(caller, request.input_region.name, "input_region.name")
                uses.append(region)
                features, pooling = decode_region_inputs(request, region, self.max_input_bytes)
            else:
                features, pooling = decode_features(request, names)
            encode: Callable[[LookupResult], bytes]
            window_bytes = None  # the result's size limit: the message's, or the window's
            window: OutputWindow | None = None
            if request.HasField("output_region"):
                window = self._output_window(
                    self.caller_of(context), request.output_region, deadline
                )
                uses.append(window.region)
                window_bytes = window.end - window.start
                encode = functools.partial(self._write_region, window, request.request_id)
            else:
                encode = functools.partial(self._encode, request.request_id)
        except BaseException:
            for region in uses:
                region.release_use()
            raise
        if observer is not None:
            observer.wire_timed("decode", time.perf_counter() - started)
        on_done = None
        if uses:

            def on_done() -> None:
                for region in uses:
                    region.release_use()

        options = LookupOptions(
            pooling,
            output_dtype=output_dtype,
            table_version=request.table_version,
            deadline=deadline,
            output_window=window_bytes,
        )
        try:
            response = await self._engine.lookup(features, options, then=encode, on_done=on_done)
            # With ``then``, the engine returns its value: here the encoded response.
            return cast(bytes, response)
        except asyncio.CancelledError:
            # The worker may still be running the lookup: its values must not land in a window
            # the client has taken back.
            if window is not None:
                window.ended.set()
            raise
        except ServiceError as exc:
            # The error comes through the engine's futures, which its traceback's frames hold:
            # a cycle that keeps every buffer of the request until a full garbage collection.
            # Without the traceback (and the errors it was raised from, with theirs) they go
            # with the request; the client sees none of them.
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            if (
                isinstance(exc, InvalidArgument)
                and request.HasField("input_region")
                and exc.field.endswith(REGION_VALUE_FIELDS)
            ):
                raise region_values_invalid(exc.field, request) from None
            raise

    def _check_features(self, request: pb.LookupRequest) -> list[str]:
        """Refuse what cannot be valid before any per-feature work: more features than any held
        version serves (a request naming a million features otherwise cost seconds of decoding
        before the engine refused it); then a feature named twice, or one whose table was
        withdrawn. Returns the features' names (the decoding reuses them)."""
        count = len(request.features)
        served = self._features_served()
        if count > served:
            raise InvalidArgument(
                "features", f"{count} features; this server serves {served} (each at most once)"
            )
        names = [feature.name for feature in request.features]
        if len(set(names)) != count:
            seen: set[str] = set()
            for i, name in enumerate(names):
                if name in seen:
                    raise InvalidArgument(f"features[{i}].name", f"feature {name!r} repeated")
                seen.add(name)
        refused = self._engine.store.refused
        if refused:
            for i, name in enumerate(names):
                if name in refused:
                    raise FailedPrecondition(f"features[{i}].name: {refused[name]}")
        return names

    def _features_served(self) -> int:
        """The most features any held table-set version serves, withdrawn ones included (they
        are refused by name); counted once per set of versions and withdrawals."""
        store = self._engine.store
        key = (store.versions_held(), len(store.refused))
        if self._served[0] == key:
            return self._served[1]
        counts = []
        for version in key[0]:
            try:
                with store.acquire(version) as snap:
                    counts.append(len(snap.features))
            except VersionNotHeld:  # dropped by a reload meanwhile: counted at the next request
                key = ((), 0)
        served = max(counts, default=0) + key[1]
        if key[0]:
            self._served = (key, served)
        return served

    def _output_window(
        self, caller: str, spec: pb.OutputRegion, deadline: float | None
    ) -> OutputWindow:
        region = self.regions.get(caller, spec.name, "output_region.name")
        try:
            size = region.info.byte_size
            if spec.offset > size:
                raise InvalidArgument(
                    "output_region.offset",
                    f"{spec.offset} is past the end of region {spec.name!r} ({size} bytes)",
                )
            end = size if spec.byte_size == 0 else spec.offset + spec.byte_size
            if end > size:
                raise InvalidArgument(
                    "output_region.byte_size",
                    f"offset {spec.offset} + byte_size {spec.byte_size} is past the end of "
                    f"region {spec.name!r} ({size} bytes)",
                )
            region.check("output_region.name")
        except BaseException:
            region.release_use()
            raise
        return OutputWindow(region, spec.offset, end, deadline)

    def _encode(self, request_id: str, result: LookupResult) -> bytes:
        started = time.perf_counter()
        response = encode_response(request_id, result)
        if self.observer is not None:
            self.observer.wire_timed("encode", time.perf_counter() - started)
            self.observer.output_written("wire", len(response))
        return response

    def _write_region(self, window: OutputWindow, request_id: str, result: LookupResult) -> bytes:
        started = time.perf_counter()
        response, written = window.write(request_id, result)
        if self.observer is not None:
            self.observer.wire_timed("encode", time.perf_counter() - started)
            self.observer.output_written("shm", written)
        return response

    async def LookupStream(
        self, request_iterator: AsyncIterator[pb.LookupRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.LookupResponse]:
        deadline = deadline_of(context)
        # The backlog's unit of fairness: an identity, however many connections it opens. A
        # server without tokens cannot tell callers apart (every one is anonymous), so there
        # each connection has a share of its own, and one stalled client leaves others room.
        identity = self.caller_of(context)
        caller: Hashable = identity if self.identities.enabled else (identity, context.peer())
        backlog = self.backlog
        # Reader task -> queue of per-request tasks -> this generator, which yields them in order.
        # A queue item is a task, None (client done) or the reader's exception. A request holds
        # one of stream_window places and one of the backlog's from when it is read until its
        # response is written.
        queue: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(self.stream_window)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    try:
                        await backlog.acquire(caller)
                    except BaseException:
                        window.release()
                        raise
                    # No await between taking the place and queueing what gives it back.
                    queue.put_nowait(
                        asyncio.ensure_future(self._stream_one(request, context, deadline))
                    )
            except Exception as exc:  # handed to the writer, which raises it as the stream status
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                try:
                    # A cancel landing as the answer completes drops it: it holds no slot.
                    response = await item
                    yield response  # resumes once gRPC has taken the message (flow control)
                finally:
                    item.cancel()
                    backlog.release(caller)
                    window.release()
        finally:
            reader.cancel()
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, asyncio.Future):
                    item.cancel()
                    backlog.release(caller)

    async def _stream_one(
        self,
        request: pb.LookupRequest,
        context: grpc.aio.ServicerContext,
        deadline: float | None,
    ) -> bytes | pb.LookupResponse:
        """One stream request's response: the lookup's bytes, or an ``Error`` reply."""
        ensure_request_id(request)
        try:
            return await self._lookup(request, context, deadline)
        except Exception as exc:
            code, message = status_for(exc, request.request_id)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("LookupStream request %s failed", request.request_id)
            error = pb.Error(code=code.value[0], message=message)
            return pb.LookupResponse(request_id=request.request_id, error=error)

    async def ListTables(
        self, request: pb.ListTablesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListTablesResponse:
        engine = self._engine
        descriptions = engine.describe()
        held = engine.store.versions_held()
        # The tables come from one snapshot; a reload since then is the next call's news, so the
        # version reported is theirs and nothing newer is listed as held.
        version = descriptions[0].version if descriptions else held[-1]
        held = (*(v for v in held if v < version), version)
        tables = [table_info(d) for d in descriptions]
        return pb.ListTablesResponse(tables=tables, table_version=version, versions_held=held)

    async def DescribeTable(
        self, request: pb.DescribeTableRequest, context: grpc.aio.ServicerContext
    ) -> pb.TableInfo:
        return table_info(self._engine.describe(request.name)[0])

    async def RegisterRegion(
        self, request: pb.RegisterRegionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterRegionResponse:
        if request.kind not in REGION_KINDS:
            raise InvalidArgument("kind", f"unknown region kind {request.kind}")
        if request.kind == pb.REGION_KIND_CUDA_IPC:
            raise Unimplemented(
                "kind: CUDA_IPC regions need a server whose lookups run on a GPU (they open "
                f"the frontend's cudaIpcMemHandle on it); this one runs on {self._engine.device}."
                " Register a SYSTEM_SHM region instead"
            )
        self.regions.register(
            self.caller_of(context),
            request.name,
            request.shm_name,
            request.offset,
            request.byte_size,
            request.nonce,
        )
        return pb.RegisterRegionResponse()

    async def ChallengeRegion(
        self, request: pb.ChallengeRegionRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChallengeRegionResponse:
        nonce = self.regions.challenge(self.caller_of(context), request.shm_name, request.offset)
        return pb.ChallengeRegionResponse(nonce=nonce, expires_in_s=NONCE_TTL_S)

    async def UnregisterRegion(
        self, request: pb.UnregisterRegionRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterRegionResponse:
        released = self.regions.unregister(self.caller_of(context), request.name)
        return pb.UnregisterRegionResponse(released=released)

    async def ListRegions(
        self, request: pb.ListRegionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRegionsResponse:
        regions = self.regions.list(self.caller_of(context))
        return pb.ListRegionsResponse(regions=[region_info(info) for info in regions])


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
    # Relies on the generated module's shape (grpcio-tools 1.85.1: it registers through
    # add_generic_rpc_handlers and add_registered_method_handlers, whose handlers are
    # RpcMethodHandler namedtuples); every server test fails if a regeneration changes that.
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
