# SPDX-License-Identifier: Apache-2.0
"""Server interceptors: bearer-token auth, and the one exception-to-status map.

:class:`ServiceInterceptor` wraps every ``ibpembed.v1`` method: it gives requests without an id
a fresh one, rejects work while the server is not ready or is draining (UNAVAILABLE), and maps
whatever the servicer raises through :func:`~ibpembed.server.status.status_for`. Failures that are
server bugs are logged with their request id and traceback; the client sees INTERNAL with that id.
Health and reflection pass through untouched, so probes keep working while draining.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ibpembed.errors import Overloaded, ServiceError, Unavailable, VersionNotHeld
from ibpembed.server.identity import CallerIdentities
from ibpembed.server.status import (
    MAX_REQUEST_ID_CHARS,
    UndecodableRequest,
    ensure_request_id,
    status_for,
    tolerant_deserializer,
)
from ibpembed_client import OVERLOADED_METADATA_KEY, VERSIONS_HELD_METADATA_KEY

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/ibpembed.v1."
HEALTH_PREFIX = "/grpc.health.v1.Health/"
LOOKUP_METHOD = "/ibpembed.v1.EmbeddingLookup/Lookup"
STREAM_METHOD = "/ibpembed.v1.EmbeddingLookup/LookupStream"


@dataclass
class ServingState:
    """Shared by the app and the interceptor.

    ``accepting`` is False until the tables are loaded and again once draining starts; ``active``
    counts ``ibpembed.v1`` RPCs that got past the gate and have not finished (the app drains
    until it reaches 0); ``refused`` those the gate turned away (the app's drain waits for it to
    stop moving).
    """

    accepting: bool = False
    reason: str = "starting"
    active: int = 0
    refused: int = 0


class RpcObserver(Protocol):
    """Optional hook for RPC metrics, called on the event loop.

    NOTE(interceptors): the metrics ride on this interceptor instead of one of their own: an
    interceptor costs every RPC a coroutine layer of grpc's handler lookup and one around the
    call, and at B=1 the metrics' own interceptor measured several per cent of the server's CPU
    per request (BENCHMARKS.md, *Metrics overhead*).
    """

    def rpc_done(self, method: str, code: grpc.StatusCode) -> None:
        """``method`` (e.g. ``/ibpembed.v1.EmbeddingLookup/Lookup``) ended with ``code``."""

    def lookup_started(self, method: str, request: Any) -> object:
        """A lookup request reached the servicer: a ``Lookup`` call, or one request of a
        ``LookupStream``. Returns the token :meth:`lookup_done` gets back."""

    def lookup_done(self, token: object, seconds: float, response: Any = None) -> None:
        """That request was answered, in any way, ``seconds`` after it started. ``response``:
        a ``LookupStream`` request's answer (wire bytes or a message with ``error``); None for a
        ``Lookup`` call, whose code :meth:`rpc_done` reports."""

    def lookups_abandoned(self, count: int) -> None:
        """``count`` requests of a failed or cancelled ``LookupStream`` got no answer."""


# A failed RPC's status, message and trailing metadata.
_Failure = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]

# How close to the server's deadline a client's cancellation counts as its deadline passing.
DEADLINE_SLACK_S = 0.02


def _cancelled_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """What a client whose call the server cancelled sees: its deadline passed, or it left.

    The server's deadline runs from the request's arrival, the client's from the call, so the
    client's expires first and its cancellation can reach the server just before the server's
    own deadline does: within DEADLINE_SLACK_S of it, that is the deadline, not a client that
    left (a test saw both orders).
    """
    remaining = context.time_remaining()
    return (
        grpc.StatusCode.DEADLINE_EXCEEDED
        if remaining is not None and remaining <= DEADLINE_SLACK_S
        else grpc.StatusCode.CANCELLED
    )


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Readiness gate, request ids, the exception -> status map and the RPC observer's timings
    for ``ibpembed.v1``."""

    def __init__(
        self,
        state: ServingState,
        observer: RpcObserver | None = None,
        *,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.state = state
        self.observer = observer
        self.write_timeout_s = write_timeout_s

    def _done(self, method: str, code: grpc.StatusCode) -> None:
        if self.observer is not None:
            self.observer.rpc_done(method, code)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if not details.method.startswith(SERVICE_PREFIX):
            return _decode_guarded(handler)
        method = details.method
        deserializer = tolerant_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(method, handler.stream_stream),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _check_state(self) -> None:
        if not self.state.accepting:
            self.state.refused += 1
            raise Unavailable(f"server not accepting requests: {self.state.reason}")

    def _failure(self, method: str, request_id: str, exc: Exception) -> _Failure:
        """Log and count a failed RPC; the status, message and trailing metadata it ends with."""
        code, message = status_for(exc, request_id)
        if isinstance(exc, ServiceError):
            log.debug("%s request %s: %s %s", method, request_id, code.name, message)
        else:
            log.error("%s request %s failed", method, request_id, exc_info=exc)
        self._done(method, code)
        # Marks an admission refusal as retryable, unlike gRPC's own RESOURCE_EXHAUSTED for an
        # oversize message (the client's RetryPolicy reads it).
        trailing: tuple[tuple[str, str], ...] = ()
        if isinstance(exc, Overloaded):
            trailing = ((OVERLOADED_METADATA_KEY, "1"),)
        elif isinstance(exc, VersionNotHeld):  # the client re-pins without parsing the message
            trailing = ((VERSIONS_HELD_METADATA_KEY, ",".join(map(str, exc.held))),)
        return code, message, trailing

    # NOTE(interceptors): a failed RPC aborts outside the ``except`` block that caught the error,
    # from a frame that no longer holds the request. gRPC keeps the AbortError that ``abort``
    # raises in a reference cycle, freed only by a full garbage collection; raised inside the
    # block it would chain the caught error, whose traceback reaches every frame of the lookup
    # and its buffers: each refused 60 MiB request kept ~180 MiB until then.
    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, failure: _Failure) -> None:
        code, message, trailing = failure
        await context.abort(code, message, trailing_metadata=trailing)

    def _wrap_unary(self, method: str, behavior: Callable) -> Callable:
        observer = self.observer if method == LOOKUP_METHOD else None

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id = ensure_request_id(request)
            started = time.perf_counter()
            try:
                self._check_state()
                if isinstance(request, UndecodableRequest):
                    raise request.error()
                self.state.active += 1
                token = observer.lookup_started(method, request) if observer is not None else None
                try:
                    response = await behavior(request, context)
                finally:
                    self.state.active -= 1
                    if observer is not None:
                        observer.lookup_done(token, time.perf_counter() - started)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:  # the deadline passed or the client went away
                self._done(method, _cancelled_code(context))
                raise
            except Exception as exc:
                failure = self._failure(method, request_id, exc)
            else:
                self._done(method, grpc.StatusCode.OK)
                return response
            del request
            await self._abort(context, failure)

        return unary

    def _wrap_stream(self, method: str, behavior: Callable) -> Callable:
        async def stream(
            request_iterator: AsyncIterator, context: grpc.aio.ServicerContext
        ) -> None:
            # Per-request ids live in the messages; a stream-level failure is logged under the
            # stream's own id (the client's x-request-id metadata, or a fresh one), cut to the
            # length a message's request_id may have: metadata may hold kilobytes.
            metadata = dict(context.invocation_metadata() or ())
            stream_id = str(metadata.get("x-request-id") or uuid.uuid4().hex)
            stream_id = stream_id[:MAX_REQUEST_ID_CHARS]
            # LookupStream requests timed one by one: the servicer answers each exactly once and
            # in order, so arrivals and answers pair up first in, first out.
            observer = self.observer if method == STREAM_METHOD else None
            arrivals: collections.deque[tuple[float, object]] = collections.deque()
            requests = request_iterator
            try:
                self._check_state()
                self.state.active += 1
                if observer is not None:
                    requests = _arriving(request_iterator, method, observer, arrivals)
                try:
                    # Closed on every way out: a write that timed out or was cancelled leaves the
                    # behavior suspended at its yield, and what it holds (backlog places, its
                    # reader task) would wait for garbage collection to finalize it.
                    async with contextlib.aclosing(behavior(requests, context)) as responses:
                        async for response in responses:
                            if observer is not None:
                                arrived, token = arrivals.popleft()
                                observer.lookup_done(token, time.perf_counter() - arrived, response)
                            await self._write(context, response)
                finally:
                    self.state.active -= 1
                    if observer is not None and arrivals:
                        observer.lookups_abandoned(len(arrivals))
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                self._done(method, _cancelled_code(context))
                raise
            except _WriteTimedOut as exc:
                # No status can follow a send still queued behind flow control (gRPC refuses the
                # second batch): the stream is cancelled, which frees it in gRPC too.
                log.info("%s %s: %s", method, stream_id, exc)
                self._done(method, grpc.StatusCode.CANCELLED)
                raise asyncio.CancelledError from None
            except Exception as exc:
                failure = self._failure(method, stream_id, exc)
            else:
                self._done(method, grpc.StatusCode.OK)
                return
            del request_iterator, requests
            await self._abort(context, failure)

        return stream

    async def _write(self, context: grpc.aio.ServicerContext, response: Any) -> None:
        """Send one stream response; a client that does not take it within the write timeout
        ends its stream, which frees what the stream holds instead of keeping it for a reader
        that may never come back."""
        write = asyncio.ensure_future(context.write(response))
        # A write abandoned below may still end in an error: retrieved here, not logged by asyncio.
        write.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            done, _ = await asyncio.wait({write}, timeout=self.write_timeout_s)
        except asyncio.CancelledError:
            write.cancel()
            raise
        if not done:
            write.cancel()
            raise _WriteTimedOut(self.write_timeout_s)
        try:
            write.result()
        except Exception:
            if context.cancelled():  # the client left while the response was being sent
                raise asyncio.CancelledError from None
            raise


class _WriteTimedOut(Exception):
    """A LookupStream response nobody took within the write timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            f"a response waited {seconds:g} s for the client to read it: stream cancelled"
        )


async def _arriving(
    requests: AsyncIterator,
    method: str,
    observer: RpcObserver,
    arrivals: collections.deque[tuple[float, object]],
) -> AsyncIterator:
    """``requests``, each reported to ``observer`` and queued in ``arrivals`` as it comes."""
    async for request in requests:
        arrivals.append((time.perf_counter(), observer.lookup_started(method, request)))
        yield request


async def _drain(result: Any, context: grpc.aio.ServicerContext) -> None:
    """Run a streaming behavior, whether it yields its responses or writes them itself."""
    if inspect.isasyncgen(result):
        async for response in result:
            await context.write(response)
    else:
        await result


def _decode_guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` (health, reflection) answering undecodable requests with INVALID_ARGUMENT.

    Otherwise untouched (no readiness gate: probes work while draining). Health needs no token,
    so without this any anonymous client could write an ERROR traceback to the log per message.
    """

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(request, context)
        return await handler.unary_unary(request, context)

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
        await check(request, context)
        await _drain(handler.unary_stream(request, context), context)

    async def stream_stream(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        async def checked() -> AsyncIterator:
            async for request in requests:
                await check(request, context)
                yield request

        await _drain(handler.stream_stream(checked(), context), context)

    kinds = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, unary_unary),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, unary_stream),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, stream_stream),
    }
    for attr, (make, behavior) in kinds.items():
        if getattr(handler, attr) is not None:
            return make(
                behavior,
                request_deserializer=tolerant_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
    return handler


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries ``authorization: Bearer <token>`` with one of the
    configured tokens (:class:`~ibpembed.server.identity.CallerIdentities`).

    Health checks are exempt: Kubernetes gRPC probes cannot send credentials.
    """

    def __init__(self, identities: CallerIdentities, observer: RpcObserver | None = None) -> None:
        if not identities.enabled:
            raise ValueError("no bearer tokens configured")
        self.identities = identities
        self.observer = observer  # told of rejected ibpembed.v1 calls (requests by code)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (
            handler is None
            or details.method.startswith(HEALTH_PREFIX)
            or self.identities.check(details.invocation_metadata) is not None
        ):
            return handler
        if self.observer is not None and details.method.startswith(SERVICE_PREFIX):
            self.observer.rpc_done(details.method, grpc.StatusCode.UNAUTHENTICATED)
        return _rejecting_handler(handler)


def _rejecting_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with UNAUTHENTICATED."""

    async def reject(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for attr, make in kinds.items():
        if getattr(handler, attr) is not None:
            return make(
                reject,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise ValueError("handler of no known kind")
