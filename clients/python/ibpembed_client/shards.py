# SPDX-License-Identifier: Apache-2.0
"""Row-sharded lookups: route each id to the server holding its row, fan out, merge.

A table set packed with ``ibpembed pack --shards N`` splits every table into N contiguous row
ranges, one server per range. A :class:`ShardMap` says which server holds which rows (table ->
row ranges -> address); it comes from the servers themselves (:meth:`ShardMap.discover`, their
ListTables answers) or from the ``shard_map.json`` the pack wrote (:meth:`ShardMap.load`).

>>> shard_map = ShardMap.discover(["shard-0:50051", "shard-1:50051", "shard-2:50051"])
>>> with ShardedLookupClient(shard_map) as client:
...     pooled = client.lookup({"cat_0": [[1, 2], [3]]}, pooling="mean")["cat_0"]  # [2, D]

Ids are global row numbers on the wire too: each server accepts the ids of its own range and
subtracts the range start itself. For one request the client

1. splits every feature's ids by range (``searchsorted`` over the range starts), keeping request
   order inside each part, and sends each server one request holding its parts of every feature;
   for SUM/MEAN a part carries only the samples with at least one id on that server, with their
   weights;
2. sends the requests concurrently (on a thread pool shared by the calling threads for
   :class:`ShardedLookupClient`, one task per server for :class:`AsyncShardedLookupClient`);
3. merges: NONE rows are put back at their request positions (bit-exact); SUM partial sums are
   added in shard order (fixed, so a result never depends on which server answered first); MEAN
   asks every server for SUM and divides the total by the sample's full number of ids, as one
   server would (weights scale rows, they do not change the divisor).

Versions. Every part of one request is pinned (``LookupRequest.table_version``) to the newest
table-set version all the shards it touches hold, as their ListTables answers said when last
asked, so a result never mixes the rows of two versions while the shards reload one after
another (servers keep ``--keep-versions`` of them). Each shard is asked every
``version_refresh_s``, on its own thread (or task) and outside the requests' path: a request
waits only for shards that have never answered; a shard that stops answering keeps its last
pin, so requests that do not touch it go on, and those that do fail naming it. Each shard
that answers FAILED_PRECONDITION with the versions it holds (a replica behind the shard's
address that has not reloaded yet, or has dropped the version) narrows what the client believes
that shard holds, and the whole request is tried again at the newest version still common, up
to ``VERSION_ATTEMPTS`` times. When the shards' versions have nothing in common (some may be
stale: versions published since a shard was last asked), the request's shards are asked again at
once before it fails. A request the caller pinned itself is sent as it is.

Replicas. Each address may name a group of replicas (``dns:///ibpembed-shard-0:50051``, a headless
Service; or ``ipv4:10.0.0.1:50051,10.0.0.2:50051``); with ``channel_options=[("grpc.lb_policy_name",
"round_robin")]`` gRPC spreads calls over them and retries an UNAVAILABLE attempt (a replica that
died mid-call) on another one (the retry policy's service config).

A SUM/MEAN merge adds fp32 partial sums, so it equals a single server's result within fp32
rounding (``ibpembed.reference.pooled_tolerance``), not bit for bit. Any failed shard fails the
whole request with that shard's status, its message naming the shard, its address and the rows
it holds (``UNAVAILABLE: shard 1 at host:port (cat_0 rows [333, 666)) ...``); a ``features[j]``
in the shard's message is renumbered to the feature's position in the caller's request.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from typing import Any

import grpc

from ibpembed_client._client import LookupClient
from ibpembed_client._errors import LookupServiceError
from ibpembed_client._options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_OUTLIER_EJECTION,
    ChannelOptions,
    KeepAliveOptions,
    OutlierEjection,
    RetryPolicy,
    TlsOptions,
)
from ibpembed_client._request import FeatureInput, OutputDType, Pooling, build_request
from ibpembed_client._result import LookupResult
from ibpembed_client._split import SplitPlan, merge_results, shard_error, split_request
from ibpembed_client.aio import AsyncLookupClient
from ibpembed_client.shard_map import ShardedTable, ShardMap, ShardRange
from ibpembed_client.v1 import lookup_pb2 as pb

__all__ = [
    "AsyncShardedLookupClient",
    "ShardMap",
    "ShardRange",
    "ShardedLookupClient",
    "ShardedTable",
    "merge_results",
    "split_request",
]

# Fan-out threads per shard for ShardedLookupClient: several callers' parts run at once.
DEFAULT_WORKERS_PER_SHARD = 4
# Seconds between asking each shard which table-set versions it holds.
DEFAULT_VERSION_REFRESH_S = 10.0
# Time a shard is given to say which versions it holds (in the background, once pinned).
VERSION_ASK_TIMEOUT_S = 5.0
# Tries of one request at successively re-pinned versions (see the module's *Versions*).
VERSION_ATTEMPTS = 3


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _VersionPin:
    """The table-set versions each shard holds, as it last said, and the newest a request's
    shards share.

    Each shard is asked on its own schedule: a shard that does not answer keeps the versions it
    last reported (its pin), so requests that do not touch it go on, and ``failure`` holds why
    it was silent for requests that need it before it ever answered.
    """

    def __init__(self, shard_map: ShardMap, refresh_s: float) -> None:
        self.shard_map = shard_map
        self.refresh_s = refresh_s
        shards = len(shard_map.addresses)
        self.held: list[frozenset[int] | None] = [None] * shards
        self.failure: list[LookupServiceError | None] = [None] * shards
        self._asked = [-math.inf] * shards

    def due(self, shard: int, at_once: bool = False) -> bool:
        """Whether ``shard`` should be asked again (marks it asked: one asker per period);
        ``at_once``: whenever it was last asked."""
        now = time.monotonic()
        if not at_once and now - self._asked[shard] < self.refresh_s:
            return False
        self._asked[shard] = now
        return True

    def record(self, shard: int, answer: Sequence[int] | LookupServiceError) -> None:
        """What ``shard`` answered; when it failed to, keep its last pin and remember why."""
        if isinstance(answer, LookupServiceError):
            self.failure[shard] = answer
        else:
            self.held[shard] = frozenset(answer)
            self.failure[shard] = None

    def narrow(self, shard: int, versions: Sequence[int]) -> None:
        """Shard ``shard`` (one of its replicas) said it holds ``versions``."""
        said = frozenset(versions)
        held = self.held[shard]
        self.held[shard] = (held & said) or said if held is not None else said

    def unknown(self, shards: Sequence[int]) -> list[int]:
        """The shards among ``shards`` that have never said what they hold."""
        return [k for k in shards if self.held[k] is None]

    def newest_common(self, shards: Sequence[int]) -> int | None:
        """The newest version every one of ``shards`` holds (0 for no shard: nothing to pin),
        None when they hold none in common. Only the shards a request touches count, so a
        silent shard's stale pin cannot stop requests that never reach it."""
        held = [h for h in (self.held[k] for k in shards) if h is not None]
        if not held:
            return 0
        common = frozenset.intersection(*held)
        return max(common) if common else None

    def version(self, shards: Sequence[int], request_id: str) -> int:
        """:meth:`newest_common`, or FAILED_PRECONDITION naming what each shard holds."""
        version = self.newest_common(shards)
        if version is None:
            listed = "; ".join(
                f"shard {k} at {self.shard_map.addresses[k]} holds {sorted(self.held[k] or ())}"
                for k in shards
            )
            raise LookupServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the shards hold no table-set version in common ({listed}): a rolling reload "
                "went further than the servers' --keep-versions, or a shard serves another set",
                request_id,
            )
        return version


def _ask_failure(err: Exception) -> LookupServiceError:
    if isinstance(err, LookupServiceError):
        return err
    return LookupServiceError(grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}")


def _never_answered(
    shard_map: ShardMap, plan: SplitPlan, shard: int, err: LookupServiceError | None
) -> LookupServiceError:
    """The error of a request that needs ``shard``, which has not yet said what it holds."""
    if err is None:
        err = LookupServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "no answer to which table-set versions it holds within the request's deadline",
        )
    asked = LookupServiceError(
        err.code, f"asked which table-set versions it holds: {err.details}", plan.request_id
    )
    return shard_error(shard_map, plan, shard, asked)


def _repinnable(err: LookupServiceError) -> bool:
    """A shard refused the pinned version and said what it holds."""
    return (
        err.code == grpc.StatusCode.FAILED_PRECONDITION
        and err.versions_held is not None
        and err.shard is not None
    )


# -- clients ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClientArgs:
    """The settings every shard's client is built with."""

    timeout: float | None
    retry: RetryPolicy | None
    keepalive: KeepAliveOptions | None
    tls: TlsOptions | None
    token: str | None
    max_message_bytes: int
    channel_options: ChannelOptions
    outlier_ejection: OutlierEjection | None

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments of each shard's client (not copied: a TlsOptions
        stays one)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ShardedLookupClient:
    """Blocking client over row-sharded servers; same lookups as :class:`LookupClient`.

    >>> with ShardedLookupClient(ShardMap.load("tables/", addresses)) as client:
    ...     rows = client.lookup({"cat_0": [[7, 123_456]]}, pooling="none")["cat_0"]

    Thread-safe. One :class:`LookupClient` (one channel) per shard; a request's parts run
    concurrently on a thread pool shared by every calling thread (grpc releases the GIL while
    waiting).

    Parameters
    ----------
    shard_map : which server holds which rows.
    timeout, retry, keepalive, tls, token, max_message_bytes, channel_options,
    outlier_ejection : as for :class:`LookupClient`, applied to every shard
        (``channel_options`` with ``("grpc.lb_policy_name", "round_robin")`` spreads each
        shard's calls over its replicas). The timeout is one deadline for the whole request:
        each shard call gets the time left when it starts, and a lookup still unanswered at the
        deadline fails with DEADLINE_EXCEEDED, time spent queued for a pool thread included.
    max_workers : threads sending shard calls (default ``DEFAULT_WORKERS_PER_SHARD`` per
        shard); with more calling threads than this allows, their parts queue.
    version_refresh_s : seconds between asking each shard which versions it holds (the pin
        moves to a newer version about this long after every shard has it).
    """

    def __init__(
        self,
        shard_map: ShardMap,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        keepalive: KeepAliveOptions | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: ChannelOptions = (),
        outlier_ejection: OutlierEjection | None = DEFAULT_OUTLIER_EJECTION,
        max_workers: int | None = None,
        version_refresh_s: float = DEFAULT_VERSION_REFRESH_S,
    ) -> None:
        self.shard_map = shard_map
        self.timeout = timeout
        args = _ClientArgs(
            timeout,
            retry,
            keepalive,
            tls,
            token,
            max_message_bytes,
            channel_options,
            outlier_ejection,
        )
        self._clients = [LookupClient(a, **args.kwargs()) for a in shard_map.addresses]
        if max_workers is None:
            max_workers = max(1, DEFAULT_WORKERS_PER_SHARD * len(self._clients))
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="ibpembed-shard")
        self._pin = _VersionPin(shard_map, version_refresh_s)
        # Guards _pin and _asking, held for bookkeeping only, never across a call: a shard that
        # hangs must not hold up requests to the others.
        self._pin_lock = threading.Lock()
        self._asking: dict[int, Future[None]] = {}
        # One thread per shard asks what it holds, so one silent shard delays no other's answer.
        self._asker = ThreadPoolExecutor(
            max(1, len(self._clients)), thread_name_prefix="ibpembed-versions"
        )

    @classmethod
    def discover(cls, addresses: Sequence[str], **client_args: Any) -> ShardedLookupClient:
        """A client over the map the servers report (:meth:`ShardMap.discover`)."""
        keys = ("tls", "token", "channel_options")
        discover_args = {k: v for k, v in client_args.items() if k in keys}
        return cls(ShardMap.discover(addresses, **discover_args), **client_args)

    def close(self) -> None:
        """Close every shard's channel and the fan-out threads."""
        self._pool.shutdown(wait=True)
        self._asker.shutdown(wait=True, cancel_futures=True)
        for client in self._clients:
            client.close()

    def __enter__(self) -> ShardedLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def versions_held(self, *, timeout: float | None = None) -> list[tuple[int, ...]]:
        """Each shard's table-set versions, as one of its servers reports them now."""
        return [client.versions_held(timeout=timeout) for client in self._clients]

    def pinned_version(self, *, timeout: float | None = None) -> int:
        """The version a lookup touching every shard is sent at: the newest every shard holds
        (asking the shards again when ``version_refresh_s`` has passed, a silent shard counting
        with the versions it last reported).

        Raises
        ------
        LookupServiceError : with ``shard`` set, for a shard that has never answered.
        """
        shards = range(len(self._clients))
        wait(self._ask(shards).values(), timeout=timeout)
        with self._pin_lock:
            for shard in self._pin.unknown(shards):
                err = self._pin.failure[shard] or LookupServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout} s"
                )
                error = LookupServiceError(
                    err.code, f"{self.shard_map.describe_shard(shard)}: {err.details}"
                )
                error.shard = shard
                raise error
        return self._common_version(shards, "", timeout)

    def _ask(self, shards: Sequence[int], at_once: bool = False) -> dict[int, Future[None]]:
        """Start asking each of ``shards`` whose pin is due (``at_once``: each one not being
        asked already) what it holds, in the background; returns the asks of ``shards`` in
        flight."""
        with self._pin_lock:
            for shard in shards:
                if shard not in self._asking and self._pin.due(shard, at_once):
                    self._asking[shard] = self._asker.submit(self._ask_one, shard)
            return {k: self._asking[k] for k in shards if k in self._asking}

    def _ask_one(self, shard: int) -> None:
        answer: Sequence[int] | LookupServiceError
        try:
            answer = self._clients[shard].versions_held(timeout=VERSION_ASK_TIMEOUT_S)
        except Exception as err:  # kept, so the requests that need this shard say why
            answer = _ask_failure(err)
        with self._pin_lock:
            del self._asking[shard]
            self._pin.record(shard, answer)

    def _version_for(self, plan: SplitPlan, deadline: float | None) -> int:
        """The version a request's parts are pinned to: the newest its shards share. Waits only
        for shards that have never said what they hold; fails naming such a shard when it does
        not answer."""
        shards = sorted(plan.requests)
        asking = self._ask(shards)
        with self._pin_lock:
            unknown = self._pin.unknown(shards)
        if unknown:
            wait([asking[k] for k in unknown if k in asking], timeout=_remaining(deadline))
        with self._pin_lock:
            for shard in self._pin.unknown(shards):
                raise _never_answered(self.shard_map, plan, shard, self._pin.failure[shard])
        return self._common_version(shards, plan.request_id, _remaining(deadline))

    def _common_version(self, shards: Sequence[int], request_id: str, timeout: float | None) -> int:
        """The newest version all of ``shards`` (each has answered once) hold. When what they
        said has nothing in common, some answers may be stale: they are asked again at once,
        waiting at most ``timeout``, before the request fails."""
        with self._pin_lock:
            version = self._pin.newest_common(shards)
        if version is not None:
            return version
        wait(self._ask(shards, at_once=True).values(), timeout=timeout)
        with self._pin_lock:
            return self._pin.version(shards, request_id)

    def lookup(
        self,
        features: Mapping[str, FeatureInput],
        pooling: Pooling = "sum",
        *,
        timeout: float | None = None,
        request_id: str = "",
        table_version: int = 0,
        output_dtype: OutputDType | None = None,
    ) -> LookupResult:
        """Look up one batch (see :meth:`LookupClient.lookup`); ids are global row numbers.

        ``table_version`` 0 pins the request to the newest version every shard holds (see the
        module's *Versions*); the result's ``table_version`` is the one that served every part.
        ``output_dtype``: the shards sum in fp32 and the merged sums are rounded once, as one
        server rounds its own. No shared-memory regions (ValueError for a request naming one).

        Raises
        ------
        LookupServiceError : the first failed shard's status (in shard order), naming it;
            DEADLINE_EXCEEDED when the shards have not all answered within ``timeout``;
            FAILED_PRECONDITION when the shards hold no version in common (naming what each
            holds) or do not hold the one asked for.
        """
        request = build_request(
            features, pooling, request_id, table_version, output_dtype=output_dtype
        )
        return self.lookup_request(request, timeout=timeout)

    def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt request, split across the shards (``timeout``: as for :meth:`lookup`)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        plan = split_request(self.shard_map, request)
        if request.table_version:  # the caller's pin
            return self._lookup_at(plan, request.table_version, deadline, timeout)
        for attempt in range(1, VERSION_ATTEMPTS + 1):
            version = self._version_for(plan, deadline)
            try:
                return self._lookup_at(plan, version, deadline, timeout)
            except LookupServiceError as err:
                if not _repinnable(err) or attempt == VERSION_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _lookup_at(
        self, plan: SplitPlan, version: int, deadline: float | None, timeout: float | None
    ) -> LookupResult:
        for part in plan.requests.values():
            part.table_version = version
        futures = {
            shard: self._pool.submit(self._send, shard, part, deadline)
            for shard, part in plan.requests.items()
        }
        # Wait for every part, even after a failure, so no call outlives this one; at the
        # deadline stop: a part still running ends then too (its grpc deadline is the same).
        _, late = wait(futures.values(), timeout=_remaining(deadline))
        for future in late:
            future.cancel()
        results: dict[int, LookupResult] = {}
        failure: BaseException | None = None
        for shard in sorted(futures):
            future = futures[shard]
            if future in late:
                error: BaseException | None = LookupServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer within the {timeout} s deadline",
                    plan.request_id,
                )
            else:
                error = future.exception()
            if error is None:
                results[shard] = future.result()
                continue
            if isinstance(error, LookupServiceError):
                error = shard_error(self.shard_map, plan, shard, error)
                if _repinnable(error):  # every refusing shard's own versions, not the first's
                    with self._pin_lock:
                        self._pin.narrow(shard, error.versions_held)  # type: ignore[arg-type]
            if failure is None:
                failure = error
        if failure is not None:
            raise failure
        return merge_results(plan, results)

    def _send(self, shard: int, request: pb.LookupRequest, deadline: float | None) -> LookupResult:
        """One shard's part, with whatever time the request has left once a thread is free."""
        remaining = _remaining(deadline)
        if remaining == 0.0:
            raise LookupServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "deadline passed while the call waited for a free thread",
                request.request_id,
            )
        return self._clients[shard].lookup_request(request, timeout=remaining)


class AsyncShardedLookupClient:
    """asyncio client over row-sharded servers (see :class:`ShardedLookupClient`).

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def __init__(
        self,
        shard_map: ShardMap,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        keepalive: KeepAliveOptions | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: ChannelOptions = (),
        outlier_ejection: OutlierEjection | None = DEFAULT_OUTLIER_EJECTION,
        version_refresh_s: float = DEFAULT_VERSION_REFRESH_S,
    ) -> None:
        self.shard_map = shard_map
        args = _ClientArgs(
            timeout,
            retry,
            keepalive,
            tls,
            token,
            max_message_bytes,
            channel_options,
            outlier_ejection,
        )
        self._clients = [AsyncLookupClient(a, **args.kwargs()) for a in shard_map.addresses]
        self._pin = _VersionPin(shard_map, version_refresh_s)
        self._asking: dict[int, asyncio.Task[None]] = {}

    async def close(self) -> None:
        """Close every shard's channel."""
        for task in list(self._asking.values()):
            task.cancel()
        for client in self._clients:
            await client.close()

    async def __aenter__(self) -> AsyncShardedLookupClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def versions_held(self, *, timeout: float | None = None) -> list[tuple[int, ...]]:
        """Each shard's table-set versions, as one of its servers reports them now."""
        return list(
            await asyncio.gather(*(c.versions_held(timeout=timeout) for c in self._clients))
        )

    async def lookup(
        self,
        features: Mapping[str, FeatureInput],
        pooling: Pooling = "sum",
        *,
        timeout: float | None = None,
        request_id: str = "",
        table_version: int = 0,
        output_dtype: OutputDType | None = None,
    ) -> LookupResult:
        """Look up one batch (see :meth:`ShardedLookupClient.lookup`)."""
        request = build_request(
            features, pooling, request_id, table_version, output_dtype=output_dtype
        )
        return await self.lookup_request(request, timeout=timeout)

    async def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt request, split across the shards (pinned as the sync client does;
        ``timeout`` is one deadline for the whole request, re-pins included)."""
        plan = split_request(self.shard_map, request)
        deadline = None if timeout is None else time.monotonic() + timeout
        if request.table_version:
            return await self._lookup_at(plan, request.table_version, timeout)
        for attempt in range(1, VERSION_ATTEMPTS + 1):
            version = await self._version_for(plan, deadline)
            try:
                return await self._lookup_at(plan, version, _remaining(deadline))
            except LookupServiceError as err:
                if not _repinnable(err) or attempt == VERSION_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _ask(self, shards: Sequence[int], at_once: bool = False) -> dict[int, asyncio.Task[None]]:
        """Start asking each of ``shards`` whose pin is due (``at_once``: each one not being
        asked already) what it holds, as tasks of their own; returns the asks of ``shards`` in
        flight."""
        for shard in shards:
            if shard not in self._asking and self._pin.due(shard, at_once):
                self._asking[shard] = asyncio.ensure_future(self._ask_one(shard))
        return {k: self._asking[k] for k in shards if k in self._asking}

    async def _ask_one(self, shard: int) -> None:
        answer: Sequence[int] | LookupServiceError
        try:
            answer = await self._clients[shard].versions_held(timeout=VERSION_ASK_TIMEOUT_S)
        except Exception as err:  # kept, so the requests that need this shard say why
            answer = _ask_failure(err)
        del self._asking[shard]
        self._pin.record(shard, answer)

    async def _version_for(self, plan: SplitPlan, deadline: float | None) -> int:
        """As :meth:`ShardedLookupClient._version_for`."""
        shards = sorted(plan.requests)
        asking = self._ask(shards)
        pending = [asking[k] for k in self._pin.unknown(shards) if k in asking]
        if pending:
            await asyncio.wait(pending, timeout=_remaining(deadline))
        for shard in self._pin.unknown(shards):
            raise _never_answered(self.shard_map, plan, shard, self._pin.failure[shard])
        version = self._pin.newest_common(shards)
        if version is not None:
            return version
        # As ShardedLookupClient._common_version: ask again at once before failing, within what
        # is left of the same deadline.
        asking = self._ask(shards, at_once=True)
        if asking:
            await asyncio.wait(asking.values(), timeout=_remaining(deadline))
        return self._pin.version(shards, plan.request_id)

    async def _lookup_at(
        self, plan: SplitPlan, version: int, timeout: float | None
    ) -> LookupResult:
        shards = sorted(plan.requests)
        for shard in shards:
            plan.requests[shard].table_version = version
        answers = await asyncio.gather(
            *(self._clients[s].lookup_request(plan.requests[s], timeout=timeout) for s in shards),
            return_exceptions=True,
        )
        results: dict[int, LookupResult] = {}
        failure: BaseException | None = None
        for shard, answer in zip(shards, answers, strict=True):
            if not isinstance(answer, BaseException):
                results[shard] = answer
                continue
            if isinstance(answer, LookupServiceError):
                answer = shard_error(self.shard_map, plan, shard, answer)
                if _repinnable(answer):  # every refusing shard's own versions, not the first's
                    self._pin.narrow(shard, answer.versions_held)  # type: ignore[arg-type]
            if failure is None:
                failure = answer
        if failure is not None:
            raise failure
        return merge_results(plan, results)
