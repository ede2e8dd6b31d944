# SPDX-License-Identifier: Apache-2.0
"""The synchronous client."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ibpembed_client._errors import LookupServiceError
from ibpembed_client._options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_OUTLIER_EJECTION,
    ChannelOptions,
    KeepAliveOptions,
    OutlierEjection,
    Retrier,
    RetryPolicy,
    TlsOptions,
    call_metadata,
)
from ibpembed_client._options import channel_options as _channel_options
from ibpembed_client._registered import (
    RegisteredRegion,
    move_inputs_to_region,
    region_of,
    region_registration,
)
from ibpembed_client._request import (
    FeatureInput,
    OutputDType,
    Pooling,
    Router,
    build_request,
    new_request_id,
    with_request_id,
)
from ibpembed_client._result import LookupResult, TableInfo, decode_response, pooled_bf16
from ibpembed_client.regions import (
    OutputRegion,
    SharedMemoryRegion,
    challenge_request,
    prove_write_access,
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
        override the client's own (a ``grpc.service_config`` replaces the retry policy's and
        the ejection's).
    outlier_ejection : take an address that keeps failing calls (a hung replica, missing
        every deadline) out of the balancing for a while (:class:`OutlierEjection`, on by
        default over ``round_robin``, or over the policy ``channel_options`` names); None = off
        (and gRPC's default ``pick_first``).
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
        outlier_ejection: OutlierEjection | None = DEFAULT_OUTLIER_EJECTION,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._retrier = Retrier(self.retry)
        self.router = router
        self._tls = tls
        self._token = token
        self._options = _channel_options(
            max_message_bytes, keepalive, self.retry, channel_options, outlier_ejection
        )
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()  # threads' first calls must share one channel
        # Regions registered through this client, by name: what output_region lookups view.
        self._regions: dict[str, RegisteredRegion] = {}

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
        output_dtype: OutputDType | None = None,
        output_region: OutputRegion | str | None = None,
        input_region: str | None = None,
        input_offset: int = 0,
    ) -> LookupResult:
        """Look up one batch.

        Parameters
        ----------
        features : feature -> :class:`FeatureBatch` or per-sample id lists.
        pooling : ``"sum"``, ``"mean"`` (``[B, D]`` float32) or ``"none"`` (``[nnz, D]`` rows).
        timeout : overall deadline in seconds (default: the client's).
        request_id : echoed back; the server logs it with failures. Empty: a fresh one for this
            call (also in the result and in a :class:`LookupServiceError`).
        table_version : serve from this table-set version (see :meth:`versions_held`); 0 =
            the newest. The result's ``table_version`` says which served it.
        output_dtype : ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` pooled values,
            rounded once by the server from its fp32 sums. bfloat16 values come back as
            ``ml_dtypes.bfloat16`` where ml_dtypes is installed, else as uint16 bit patterns
            (:func:`bf16_to_float32`). Not with ``"none"``.
        output_region : a region registered with :meth:`register_region` (its name, or an
            :class:`OutputRegion` window of it): the server writes the values there and the
            result's arrays are views of that memory (no copy).
        input_region, input_offset : a registered region that the ids, lengths and weights
            are copied into, from byte ``input_offset`` of it, for the server to read instead
            of the request's bytes. Lookups running at once need disjoint parts.

        Raises
        ------
        LookupServiceError : with the status code (NOT_FOUND, INVALID_ARGUMENT, ...);
            FAILED_PRECONDITION for a version the server does not hold (``versions_held`` of
            the error lists those it does).
        """
        request = build_request(
            features,
            pooling,
            request_id or new_request_id(),
            table_version,
            output_dtype=output_dtype,
            output_region=output_region,
        )
        if input_region is not None:
            move_inputs_to_region(request, self._regions, input_region, input_offset)
        return self.lookup_request(request, timeout=timeout)

    def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt :class:`~ibpembed_client.v1.lookup_pb2.LookupRequest` (one without a
        ``request_id`` is sent as a copy with a fresh one: :func:`with_request_id`)."""
        request = with_request_id(request)
        stub = self._stub(self.router(request) if self.router else None)
        metadata = call_metadata(self._token)
        region = region_of(self._regions, request)
        response = self._call(
            lambda t: stub.Lookup(request, timeout=t, metadata=metadata),
            timeout,
            request.request_id,
        )
        return decode_response(response, region, pooled_bf16=pooled_bf16(request))

    # -- shared-memory regions -------------------------------------------------------------
    def register_region(
        self,
        name: str,
        memory: SharedMemoryRegion,
        *,
        offset: int = 0,
        byte_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """Register ``[offset, offset + byte_size)`` of ``memory`` (default: to its end) with
        the server as ``name``, for lookups' ``output_region`` / ``input_region``.

        The server registers only memory the caller proves it can write: this asks it for a
        nonce, writes the nonce at the region's first bytes, and sends it back with the
        registration (see :func:`ibpembed_client.regions.challenge_request`)."""
        request, registered = region_registration(name, memory, offset, byte_size)
        metadata = call_metadata(self._token)
        challenge = challenge_request(request)
        answer = self._call(
            lambda t: self._stub().ChallengeRegion(challenge, timeout=t, metadata=metadata),
            timeout,
        )
        request.nonce = prove_write_access(memory, offset, answer.nonce)
        self._call(
            lambda t: self._stub().RegisterRegion(request, timeout=t, metadata=metadata), timeout
        )
        self._regions[name] = registered

    def unregister_region(self, name: str = "", *, timeout: float | None = None) -> int:
        """Release region ``name`` on the server (every region of this caller for ``""``);
        returns how many were released."""
        metadata = call_metadata(self._token)
        request = pb.UnregisterRegionRequest(name=name)
        response = self._call(
            lambda t: self._stub().UnregisterRegion(request, timeout=t, metadata=metadata),
            timeout,
        )
        if name:
            self._regions.pop(name, None)
        else:
            self._regions.clear()
        return response.released

    def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        """This caller's regions as the server holds them."""
        metadata = call_metadata(self._token)
        response = self._call(
            lambda t: self._stub().ListRegions(
                pb.ListRegionsRequest(), timeout=t, metadata=metadata
            ),
            timeout,
        )
        return list(response.regions)

    def lookup_stream(
        self,
        requests: Iterable[pb.LookupRequest],
        *,
        timeout: float | None = None,
        stream_id: str = "",
    ) -> Iterator[LookupResult]:
        """Pipeline many requests on one stream; results come back in request order.

        A request that fails yields a result with ``error`` set; the stream goes on. Build
        requests with :func:`build_request`. Not retried (requests may have run). An exception
        raised while iterating ``requests`` (or naming a region this client has not registered)
        cancels the stream and is raised here as it was.
        """
        timeout = self.timeout if timeout is None else timeout
        # The server logs a failed stream under this id: the error then carries the same one.
        stream_id = stream_id or new_request_id()
        # Responses come back in request order: each is decoded with its request's region.
        sent: collections.deque[tuple[RegisteredRegion | None, np.dtype | None]] = (
            collections.deque()
        )
        # Raised in gRPC's sending thread, an exception would end the call UNKNOWN "Exception
        # iterating requests!": kept for the caller instead, and the call cancelled.
        failed: list[Exception] = []
        call_made = threading.Event()

        def sending() -> Iterator[pb.LookupRequest]:
            try:
                for request in requests:
                    sent.append((region_of(self._regions, request), pooled_bf16(request)))
                    yield request
            except Exception as exc:
                failed.append(exc)
                call_made.wait()  # gRPC may start sending before the call is returned
                responses.cancel()

        try:
            responses = self._stub().LookupStream(
                sending(), timeout=timeout, metadata=call_metadata(self._token, stream_id)
            )
        finally:
            call_made.set()
        try:
            for response in responses:
                region, bf16 = sent.popleft()
                yield decode_response(response, region, pooled_bf16=bf16)
        except grpc.RpcError as err:
            if failed:
                raise failed[0] from None
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
