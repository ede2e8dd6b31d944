# SPDX-License-Identifier: Apache-2.0
"""The asyncio client: :class:`AsyncLookupClient` mirrors :class:`~ibpembed_client.LookupClient`."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
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


class AsyncLookupClient:
    """asyncio client; same parameters and methods as the sync client, as coroutines.

    >>> async with AsyncLookupClient("127.0.0.1:50051") as client:
    ...     result = await client.lookup({"cat_0": [[1, 2], [3]]})

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
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
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Regions registered through this client, by name: what output_region lookups view.
        self._regions: dict[str, RegisteredRegion] = {}

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(target, options=self._options)
            else:
                channel = grpc.aio.secure_channel(
                    target, self._tls.credentials(), options=self._options + self._tls.options()
                )
            self._channels[target] = channel
        return channel

    def _stub(self, target: str | None = None) -> lookup_pb2_grpc.EmbeddingLookupStub:
        return lookup_pb2_grpc.EmbeddingLookupStub(self._channel(target or self.target))

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncLookupClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        fn: Callable[[float | None], Awaitable[T]],
        timeout: float | None,
        request_id: str = "",
    ) -> T:
        """``await fn(remaining_seconds)``, retried as :class:`RetryPolicy` says, inside one
        deadline."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                result = await fn(remaining)
            except grpc.RpcError as err:
                pause = self._retrier.pause_before_retry(err, attempt, deadline)
                if pause is None:
                    raise LookupServiceError.from_rpc_error(err, request_id, attempt) from None
                await asyncio.sleep(pause)
            else:
                self._retrier.succeeded()
                return result

    async def lookup(
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
        """Look up one batch (see :meth:`ibpembed_client.LookupClient.lookup`)."""
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
        return await self.lookup_request(request, timeout=timeout)

    async def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt ``LookupRequest``."""
        request = with_request_id(request)
        stub = self._stub(self.router(request) if self.router else None)
        metadata = call_metadata(self._token)
        region = region_of(self._regions, request)
        response = await self._call(
            lambda t: stub.Lookup(request, timeout=t, metadata=metadata),
            timeout,
            request.request_id,
        )
        return decode_response(response, region, pooled_bf16=pooled_bf16(request))

    async def lookup_stream(
        self,
        requests: AsyncIterable[pb.LookupRequest] | Iterable[pb.LookupRequest],
        *,
        timeout: float | None = None,
        stream_id: str = "",
    ) -> AsyncIterator[LookupResult]:
        """Pipeline many requests on one stream; results in request order (see the sync client)."""
        timeout = self.timeout if timeout is None else timeout
        # The server logs a failed stream under this id: the error then carries the same one.
        stream_id = stream_id or new_request_id()
        # Responses come back in request order: each is decoded with its request's region.
        sent: collections.deque[tuple[RegisteredRegion | None, np.dtype | None]] = (
            collections.deque()
        )

        # grpc.aio answers an exception from the requests by cancelling the call, which the
        # loop below would see as its own cancellation: kept for the caller instead.
        failed: list[Exception] = []

        async def sending() -> AsyncIterator[pb.LookupRequest]:
            try:
                if isinstance(requests, AsyncIterable):
                    async for request in requests:
                        sent.append((region_of(self._regions, request), pooled_bf16(request)))
                        yield request
                else:
                    for request in requests:
                        sent.append((region_of(self._regions, request), pooled_bf16(request)))
                        yield request
            except Exception as exc:
                failed.append(exc)
                call.cancel()

        call = self._stub().LookupStream(
            sending(), timeout=timeout, metadata=call_metadata(self._token, stream_id)
        )
        try:
            async for response in call:
                region, bf16 = sent.popleft()
                yield decode_response(response, region, pooled_bf16=bf16)
        except (grpc.RpcError, asyncio.CancelledError) as err:
            if failed:
                raise failed[0] from None
            if isinstance(err, asyncio.CancelledError):
                raise
            raise LookupServiceError.from_rpc_error(err, stream_id) from None

    async def register_region(
        self,
        name: str,
        memory: SharedMemoryRegion,
        *,
        offset: int = 0,
        byte_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """See :meth:`ibpembed_client.LookupClient.register_region`."""
        request, registered = region_registration(name, memory, offset, byte_size)
        metadata = call_metadata(self._token)
        challenge = challenge_request(request)
        answer = await self._call(
            lambda t: self._stub().ChallengeRegion(challenge, timeout=t, metadata=metadata),
            timeout,
        )
        request.nonce = prove_write_access(memory, offset, answer.nonce)
        await self._call(
            lambda t: self._stub().RegisterRegion(request, timeout=t, metadata=metadata), timeout
        )
        self._regions[name] = registered

    async def unregister_region(self, name: str = "", *, timeout: float | None = None) -> int:
        """See :meth:`ibpembed_client.LookupClient.unregister_region`."""
        metadata = call_metadata(self._token)
        request = pb.UnregisterRegionRequest(name=name)
        response = await self._call(
            lambda t: self._stub().UnregisterRegion(request, timeout=t, metadata=metadata),
            timeout,
        )
        if name:
            self._regions.pop(name, None)
        else:
            self._regions.clear()
        return response.released

    async def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        """This caller's regions as the server holds them."""
        metadata = call_metadata(self._token)
        response = await self._call(
            lambda t: self._stub().ListRegions(
                pb.ListRegionsRequest(), timeout=t, metadata=metadata
            ),
            timeout,
        )
        return list(response.regions)

    async def list_tables(self, *, timeout: float | None = None) -> list[TableInfo]:
        """Every table the server holds."""
        metadata = call_metadata(self._token)
        response = await self._call(
            lambda t: self._stub().ListTables(pb.ListTablesRequest(), timeout=t, metadata=metadata),
            timeout,
        )
        return [TableInfo.from_proto(t) for t in response.tables]

    async def versions_held(self, *, timeout: float | None = None) -> tuple[int, ...]:
        """The table-set versions the server holds, oldest first."""
        metadata = call_metadata(self._token)
        response = await self._call(
            lambda t: self._stub().ListTables(pb.ListTablesRequest(), timeout=t, metadata=metadata),
            timeout,
        )
        return tuple(response.versions_held) or (response.table_version,)

    async def describe_table(self, name: str, *, timeout: float | None = None) -> TableInfo:
        """One table; :class:`LookupServiceError` NOT_FOUND for an unknown name."""
        metadata = call_metadata(self._token)
        request = pb.DescribeTableRequest(name=name)
        info = await self._call(
            lambda t: self._stub().DescribeTable(request, timeout=t, metadata=metadata), timeout
        )
        return TableInfo.from_proto(info)

    async def is_serving(self, service: str = "", *, timeout: float | None = 5.0) -> bool:
        """gRPC health check: True when the server reports SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel(self.target))
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
