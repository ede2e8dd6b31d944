# SPDX-License-Identifier: Apache-2.0
"""The synchronous client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ibpembed_client._common import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ChannelOptions,
    FeatureInput,
    KeepAliveOptions,
    LookupResult,
    LookupServiceError,
    Pooling,
    Retrier,
    RetryPolicy,
    Router,
    TableInfo,
    TlsOptions,
    build_request,
    call_metadata,
    decode_response,
)
from ibpembed_client._common import (
    channel_options as _channel_options,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc

T = TypeVar("T")


class LookupClient:
    """Blocking client for ``ibpembed.v1.EmbeddingLookup``.

    >>> with LookupClient("127.0.0.1:50051") as client:
    ...     result = client.lookup({"cat_0": [[1, 2], [3]]}, pooling="sum")
    ...     result["cat_0"].shape                     # (2, 128) float32

    Thread-safe: one client (one gRPC channel per target: one HTTP/2 connection, or one per
    resolved address with ``round_robin``) serves many threads.

    Parameters
    ----------
    target : ``host:port`` for every call the router does not redirect, or any gRPC target
        name: ``dns:///ibpembed-shard-0.ibpembed:50051`` with
        ``channel_options=[("grpc.lb_policy_name", "round_robin")]`` spreads calls over every
        address the name resolves to (the replicas behind a headless Service).
    timeout : default overall deadline per call in seconds (retries included); None = no
        deadline. Each method also takes ``timeout``.
    retry : retry policy (UNAVAILABLE by gRPC's own retries, overload refusals here, within a
        retry budget); ``RetryPolicy(max_attempts=1)`` disables retries.
    keepalive : HTTP/2 keepalive settings; None = gRPC defaults (no client pings).
    tls : TLS / mTLS settings; None = plaintext.
    token : bearer token sent as ``authorization: Bearer <token>``.
    max_message_bytes : largest message sent or received (default 64 MiB; a B=2048
        DCNv2-profile pooled response is ~27 MB).
    router : optional hook choosing the target per lookup request (scale-out).
    channel_options : more gRPC channel arguments, e.g. the load-balancing policy; they
        override the client's own (a ``grpc.service_config`` replaces the retry policy's).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        keepalive: KeepAliveOptions | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        router: Router | None = None,
        channel_options: ChannelOptions = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._retrier = Retrier(self.retry)
        self.router = router
        self._tls = tls
        self._token = token
        self._options = _channel_options(max_message_bytes, keepalive, self.retry, channel_options)
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()  # threads' first calls must share one channel

    # -- channels --------------------------------------------------------------------------
    def _channel(self, target: str) -> grpc.Channel:
        channel = self._channels.get(target)
        if channel is not None:
            return channel
        with self._channels_lock:
            channel = self._channels.get(target)
            if channel is None:
                if self._tls is None:
                    channel = grpc.insecure_channel(target, options=self._options)
                else:
                    channel = grpc.secure_channel(
                        target,
                        self._tls.credentials(),
                        options=self._options + self._tls.options(),
                    )
                self._channels[target] = channel
        return channel

    def _stub(self, target: str | None = None) -> lookup_pb2_grpc.EmbeddingLookupStub:
        return lookup_pb2_grpc.EmbeddingLookupStub(self._channel(target or self.target))

    def close(self) -> None:
        """Close every channel."""
        with self._channels_lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- retries ---------------------------------------------------------------------------
    def _call(
        self, fn: Callable[[float | None], T], timeout: float | None, request_id: str = ""
    ) -> T:
        """``fn(remaining_seconds)``, retried as :class:`RetryPolicy` says, inside one overall
        deadline."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                result = fn(remaining)
            except grpc.RpcError as err:
                pause = self._retrier.pause_before_retry(err, attempt, deadline)
                if pause is None:
                    raise LookupServiceError.from_rpc_error(err, request_id, attempt) from None
                time.sleep(pause)
            else:
                self._retrier.succeeded()
                return result

    # -- RPCs ------------------------------------------------------------------------------
    def lookup(
        self,
        features: Mapping[str, FeatureInput],
        pooling: Pooling = "sum",
        *,
        timeout: float | None = None,
        request_id: str = "",
        table_version: int = 0,
    ) -> LookupResult:
        """Look up one batch.

        Parameters
        ----------
        features : feature -> :class:`FeatureBatch` or per-sample id lists.
        pooling : ``"sum"``, ``"mean"`` (``[B, D]`` float32) or ``"none"`` (``[nnz, D]`` rows).
        timeout : overall deadline in seconds (default: the client's).
        request_id : echoed back; the server logs it with failures.
        table_version : serve from this table-set version (see :meth:`versions_held`); 0 =
            the newest. The result's ``table_version`` says which served it.

        Raises
        ------
        LookupServiceError : with the status code (NOT_FOUND, INVALID_ARGUMENT, ...);
            FAILED_PRECONDITION for a version the server does not hold (``versions_held`` of
            the error lists those it does).
        """
        request = build_request(features, pooling, request_id, table_version)
        return self.lookup_request(request, timeout=timeout)

    def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt :class:`~ibpembed_client.v1.lookup_pb2.LookupRequest`."""
        stub = self._stub(self.router(request) if self.router else None)
        metadata = call_metadata(self._token)
        response = self._call(
            lambda t: stub.Lookup(request, timeout=t, metadata=metadata),
            timeout,
            request.request_id,
        )
        return decode_response(response)

    def lookup_stream(
        self,
        requests: Iterable[pb.LookupRequest],
        *,
        timeout: float | None = None,
        stream_id: str = "",
    ) -> Iterator[LookupResult]:
        """Pipeline many requests on one stream; results come back in request order.

        A request that fails yields a result with ``error`` set; the stream goes on. Build
        requests with :func:`build_request`. Not retried (requests may have run).
        """
        timeout = self.timeout if timeout is None else timeout
        responses = self._stub().LookupStream(
            iter(requests), timeout=timeout, metadata=call_metadata(self._token, stream_id)
        )
        try:
            for response in responses:
                yield decode_response(response)
        except grpc.RpcError as err:
            raise LookupServiceError.from_rpc_error(err, stream_id) from None

    def list_tables(self, *, timeout: float | None = None) -> list[TableInfo]:
        """Every table the server holds."""
        metadata = call_metadata(self._token)
        response = self._call(
            lambda t: self._stub().ListTables(pb.ListTablesRequest(), timeout=t, metadata=metadata),
            timeout,
        )
        return [TableInfo.from_proto(t) for t in response.tables]

    def versions_held(self, *, timeout: float | None = None) -> tuple[int, ...]:
        """The table-set versions the server holds and serves on request, oldest first."""
        metadata = call_metadata(self._token)
        response = self._call(
            lambda t: self._stub().ListTables(pb.ListTablesRequest(), timeout=t, metadata=metadata),
            timeout,
        )
        return tuple(response.versions_held) or (response.table_version,)

    def describe_table(self, name: str, *, timeout: float | None = None) -> TableInfo:
        """One table; :class:`LookupServiceError` NOT_FOUND for an unknown name."""
        metadata = call_metadata(self._token)
        request = pb.DescribeTableRequest(name=name)
        return TableInfo.from_proto(
            self._call(
                lambda t: self._stub().DescribeTable(request, timeout=t, metadata=metadata),
                timeout,
            )
        )

    def is_serving(self, service: str = "", *, timeout: float | None = 5.0) -> bool:
        """gRPC health check: True when the server reports SERVING ("" = the whole server)."""
        stub = health_pb2_grpc.HealthStub(self._channel(self.target))
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
