# SPDX-License-Identifier: Apache-2.0
"""The grpc.aio server: wiring of store, engine, servicer, interceptors, health and reflection.

Lifecycle: bind gRPC and metrics -> load the tables (health NOT_SERVING, lookups UNAVAILABLE,
``/readyz`` 503, ``ibpembed_loading`` 1 with its progress) -> choose the device (on a GPU node the
CUDA self-test, :mod:`ibpembed.selftest`) -> SERVING. Binding first means a busy port fails at
once rather than after a minutes-long load, and probes and scrapes tell "loading" from "dead"
meanwhile. A table set from a directory is reloaded live when its manifest changes and on SIGHUP
(:mod:`ibpembed.server.reload`). On SIGTERM or SIGINT: stop
admitting new RPCs (UNAVAILABLE; health NOT_SERVING), let in-flight RPCs finish for up to
``grace_s``, stop the kernel threads, exit 0. A reload in progress gets the same grace period
(not one of its own); one still running when it ends is abandoned.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ibpembed.engine import LookupEngine, LookupObserver, resolve_device
from ibpembed.selftest import choose_device
from ibpembed.server import demo
from ibpembed.server.backlog import StreamBacklog
from ibpembed.server.config import ServerConfig
from ibpembed.server.identity import CallerIdentities, read_tokens
from ibpembed.server.interceptors import (
    BearerTokenInterceptor,
    RpcObserver,
    ServiceInterceptor,
    ServingState,
)
from ibpembed.server.memory import keep_freed_memory
from ibpembed.server.metrics import ServerMetrics
from ibpembed.server.ports import bind_problem
from ibpembed.server.regions import RegionRegistry
from ibpembed.server.reload import ReloadObserver, TableSetReloader, in_daemon_thread
from ibpembed.server.servicer import EmbeddingLookupServicer, OutputObserver, add_to_server
from ibpembed.tables import mapping_guard
from ibpembed.tables.store import TableStore
from ibpembed_client.v1 import lookup_pb2

log = logging.getLogger(__name__)

# How often a draining server checks whether its in-flight RPCs are done.
_DRAIN_POLL_S = 0.05
# The console's load progress: a line at most this often, plus the first and the last.
_PROGRESS_EVERY_S = 2.0
# The drain ends once no RPC has been refused for this long, or this long after the last
# in-flight RPC finished while calls keep coming (see LookupServer._drained).
_DRAIN_QUIET_S = 0.1
_DRAIN_QUIET_MAX_S = 1.0
# The thread ``serve`` loads the table set in; ``ibpembed serve`` looks for it at exit.
LOAD_THREAD = "ibpembed-load"
SERVICE_NAME = lookup_pb2.DESCRIPTOR.services_by_name["EmbeddingLookup"].full_name
# lookup.proto's typed mirror (docs/client.md), for the banner's grpcurl query: JSON ids and float
# values instead of base64 bytes. Only a checkout has it (an installed wheel has no proto/).
TYPED_PROTO_ROOT = Path(__file__).resolve().parents[3] / "proto" / "typed"
TYPED_PROTO = "ibpembed/v1/lookup_typed.proto"


class ServerObserver(LookupObserver, RpcObserver, ReloadObserver, OutputObserver, Protocol):
    """The metrics hook of a whole server (ServerMetrics implements it)."""


def load_store(
    config: ServerConfig, progress: Callable[[int, int], None] | None = None
) -> TableStore:
    """The packed table set in ``config.tables``, or the embedded demo set. ``progress(done,
    total)``: tables loaded (or, for the demo, built) so far."""
    # On a GPU the store places every snapshot's tables for the CUDA kernels: index and masks
    # in device memory, payloads registered in place for zero-copy reads.
    device = resolve_device(config.device)
    if config.tables is not None:
        return TableStore.load(
            config.tables,
            verify=config.verify_payloads,
            prefetch=config.prefetch_payloads,
            keep_versions=config.keep_versions,
            progress=progress,
            device=device,
        )
    tables = demo.build(config.demo_max_rows, progress=progress)
    return TableStore.from_tables(tables, device=device)


def load_and_check(
    config: ServerConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[TableStore, str]:
    """The tables (:func:`load_store`) and the device to serve them on (``"cpu"`` or
    ``"cuda"``, after the CUDA self-test on them: :func:`ibpembed.selftest.choose_device`)."""
    store = load_store(config, progress)
    with store.acquire() as snap:
        device = choose_device(config.device, snap.tables)
    if device.type != store.device.type:
        # --device auto after a failed self-test: the store was placed for the GPU, and the
        # CPU kernels read the host tables of a CPU store. Loading again costs a second load
        # only on this path, which the log already reports loudly.
        store = load_store(dataclasses.replace(config, device="cpu"), progress)
    return store, device.type


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


class LookupServer:
    """One serving process.

    Two steps: :meth:`start` binds the port (health NOT_SERVING, every ``ibpembed.v1`` RPC
    UNAVAILABLE), :meth:`serve_tables` puts the tables behind it (SERVING). With ``store``
    given, :meth:`start` does both.

    Parameters
    ----------
    config : validated settings.
    store : the tables (see :func:`load_store`), or None to pass them to :meth:`serve_tables`
        once loaded.
    observer : optional metrics hook: kernel calls (engine) and finished RPCs (interceptor).
    """

    def __init__(
        self,
        config: ServerConfig,
        store: TableStore | None = None,
        *,
        observer: ServerObserver | None = None,
    ) -> None:
        self.config = config
        self.state = ServingState()
        self.observer = observer
        self._store = store
        # Both set by serve_tables; the gate refuses every RPC that would need them before.
        self.engine: LookupEngine | None = None
        self.reloader: TableSetReloader | None = None
        # Who a call is (its token's identity, or anonymous without tokens): owns regions.
        self.identities = CallerIdentities(
            read_tokens(config.auth_token_file, config.auth_tokens_file)
        )
        # Shared-memory regions clients registered; their descriptors close at stop.
        self.regions = RegionRegistry(config.max_regions)
        backlog = StreamBacklog.for_server(config.max_inflight, config.stream_window)
        self.servicer = EmbeddingLookupServicer(
            None,
            stream_window=config.stream_window,
            regions=self.regions,
            identities=self.identities,
            backlog=backlog,
            observer=observer,
            max_input_bytes=config.max_message_bytes,
        )
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._reloads: set[asyncio.Task] = set()

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.identities.enabled:
            interceptors.append(BearerTokenInterceptor(self.identities, self.observer))
        interceptors.append(
            ServiceInterceptor(
                self.state, self.observer, write_timeout_s=self.config.stream_write_timeout_s
            )
        )
        return interceptors

    def _credentials(self) -> grpc.ServerCredentials | None:
        cfg = self.config
        if cfg.tls_cert is None or cfg.tls_key is None:
            return None
        ca = _read(cfg.tls_client_ca) if cfg.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(cfg.tls_key), _read(cfg.tls_cert))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    async def start(self) -> int:
        """Bind and start answering: health NOT_SERVING until the tables are served (at once
        when the server was given its store); returns the bound port."""
        cfg = self.config
        server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                # Let clients keep idle connections alive with pings (client keepalive).
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                # grpc sets SO_REUSEPORT by default: a second server on a busy port would start
                # and the kernel would split the connections between the two.
                ("grpc.so_reuseport", 0),
            ],
        )
        add_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
        address = f"{cfg.host}:{cfg.port}"
        credentials = self._credentials()
        # Probed first: grpc's C core logs its own error line for a port it cannot bind (on
        # stderr, before ours), and its RuntimeError says only "Failed to bind to address".
        problem = bind_problem(cfg.host, cfg.port)
        if problem is not None:
            raise RuntimeError(f"cannot listen on {address}: {problem}")
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError:  # taken since the probe, or refused by grpc alone
            problem = bind_problem(cfg.host, cfg.port)
            raise RuntimeError(
                f"cannot listen on {address}: "
                f"{problem or 'grpc could not bind it (GRPC_VERBOSITY=debug says why)'}"
            ) from None
        # grpc's health servicer starts the whole server ("") SERVING: not before the tables.
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state.reason = "loading the table set"
        await server.start()
        self._server, self.port = server, port
        if self._store is not None:
            try:
                with self._store.acquire() as snap:
                    device = choose_device(cfg.device, snap.tables).type
                await self.serve_tables(self._store, device)
            except BaseException:  # e.g. --device cuda without a GPU: close the port again
                await server.stop(0)
                raise
        return port

    async def serve_tables(self, store: TableStore, device: str) -> None:
        """Serve ``store`` on ``device`` (``"cpu"`` or ``"cuda"``): SERVING from here on."""
        cfg = self.config
        self.engine = LookupEngine(
            store,
            max_workers=cfg.workers,
            max_inflight=cfg.max_inflight,
            device=device,
            dedupe_max_unique_fraction=cfg.dedupe_max_unique_fraction,
            dedupe_min_ids=cfg.dedupe_min_ids,
            inline_max_ids=cfg.inline_max_ids,
            hot_tier=cfg.hot_tier,
            hot_tier_refresh_s=cfg.hot_tier_refresh_s,
            hbm_tier=cfg.hbm_tier,
            hbm_tier_form=cfg.hbm_tier_form,
            # Leave room for the response's framing (names, shapes: ~50 bytes a feature).
            max_output_bytes=cfg.max_message_bytes * 15 // 16,
            observer=self.observer,
        )
        self.servicer.engine = self.engine
        # None for in-memory tables (the embedded demo): nothing on disk to reload from.
        if store.directory is not None:
            self.reloader = TableSetReloader(
                store,
                poll_s=cfg.reload_poll_s,
                tier=self.engine.tier,
                observer=self.observer,
            )
        self.state.accepting, self.state.reason = True, "serving"
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.reloader is not None:
            self.reloader.start()

    def request_reload(self) -> None:
        """Reload the table set in the background (SIGHUP); outcomes are logged and counted."""
        if self.engine is None:
            log.warning("reload requested while the tables load: ignored (the load reads the set)")
            return
        if self.reloader is None:
            log.warning("reload requested: serving in-memory tables, nothing to reload")
            return
        task = asyncio.get_running_loop().create_task(self.reloader.reload("SIGHUP"))
        self._reloads.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._reload_ended)

    def _reload_ended(self, task: asyncio.Task) -> None:
        self._reloads.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("reload on SIGHUP failed", exc_info=task.exception())

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new RPCs, finish in-flight ones and a reload in progress (together, up
        to the grace period), stop.

        The grace period starts at once: a reload still running when it ends is logged and
        abandoned, not waited for (harmless: see :mod:`ibpembed.server.reload`). The gRPC server
        keeps running while in-flight RPCs finish, so that new RPCs get a clean UNAVAILABLE from
        the interceptor (grpc's own shutdown answers CANCELLED to RPCs arriving meanwhile, which
        clients must not retry).
        """
        grace = self.config.grace_s if grace_s is None else grace_s
        if self.engine is None:  # stopped while loading: nothing was ever admitted
            self.state.accepting, self.state.reason = False, "stopping"
            if self._server is not None:
                await self._server.stop(0)
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + grace
        self.state.accepting, self.state.reason = False, "draining for shutdown"
        await self.health.enter_graceful_shutdown()
        drained = loop.create_task(self._drained())
        reloads = loop.create_task(self._reloads_finished()) if self.reloader else None
        waits = {drained} if reloads is None else {drained, reloads}
        await asyncio.wait(waits, timeout=max(0.0, give_up - loop.time()))
        drained.cancel()  # out of time: grpc's stop below cancels what is still in flight
        if reloads is not None and not reloads.done():
            assert self.reloader is not None
            if self.reloader.reloading:
                log.warning(
                    "a table-set reload was still running when the %.1f s grace period ended:"
                    " abandoned (nothing it loads will be served)",
                    grace,
                )
            reloads.cancel()
            await self._abandon_reloads()
        await asyncio.wait(waits)  # cancelled ones end at once
        if self._server is not None:
            await self._server.stop(max(0.0, give_up - loop.time()))
        # Kernels of cancelled RPCs may still run; wait for them off the loop.
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        self.regions.close()

    async def _drained(self) -> None:
        """In-flight RPCs have finished, and no new one has been refused for _DRAIN_QUIET_S (or
        _DRAIN_QUIET_MAX_S have passed since the last finished).

        NOTE(server): grpc accepts a call before its handler runs, and on a busy event loop calls
        sent just before the signal can still be waiting for theirs when the last in-flight one
        ends. grpc's stop would answer them CANCELLED, which clients do not retry (4 of ~1,500
        calls in one SIGTERM fault trial on a loaded host); waiting until the gate has stopped
        refusing lets each reach it and get UNAVAILABLE.
        """
        while self.state.active:
            await asyncio.sleep(_DRAIN_POLL_S)
        # Bounded: a load balancer that keeps sending would hold it open for the whole grace.
        for _ in range(round(_DRAIN_QUIET_MAX_S / _DRAIN_QUIET_S)):
            refused = self.state.refused
            await asyncio.sleep(_DRAIN_QUIET_S)
            if self.state.refused == refused and not self.state.active:
                return

    async def _reloads_finished(self) -> None:
        """A reload in progress finishes; later ones are refused, so the SIGHUP tasks still
        queued return at once (their failures are logged as they end)."""
        assert self.reloader is not None
        await self.reloader.stop()
        if self._reloads:
            await asyncio.wait(set(self._reloads))

    async def _abandon_reloads(self) -> None:
        assert self.reloader is not None
        await self.reloader.abandon()
        pending = set(self._reloads)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


def _grpcurl_query(feature: str) -> tuple[str, str, str]:
    """How the banner's grpcurl query reads: its title, its proto flags and its JSON body."""
    if (TYPED_PROTO_ROOT / TYPED_PROTO).is_file():
        try:  # relative in the usual case, `ibpembed serve` run from the checkout's root
            root = str(TYPED_PROTO_ROOT.relative_to(Path.cwd()))
        except ValueError:
            root = str(TYPED_PROTO_ROOT)
        body = f'{{"features": [{{"name": "{feature}", "ids": ["1", "2"], "lengths": [2]}}]}}'
        flags = f" -import-path {shlex.quote(root)} -proto {TYPED_PROTO}"
        return "grpcurl, typed proto", flags, body
    # Reflection alone: lookup.proto's bytes fields, which grpcurl's JSON spells in base64.
    ids = base64.b64encode((1).to_bytes(8, "little") + (2).to_bytes(8, "little")).decode()
    lengths = base64.b64encode((2).to_bytes(4, "little")).decode()
    body = f'{{"features": [{{"name": "{feature}", "ids": "{ids}", "lengths": "{lengths}"}}]}}'
    return "grpcurl, ids as little-endian int64 bytes in base64", "", body


def example_query(host: str, port: int, feature: str, *, tls: bool, token: bool) -> str:
    """Copy-pasteable queries (Python client and grpcurl) for the banner."""
    host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "::") else host
    target = f"{host}:{port}"
    client_args = f"'{target}'"
    grpcurl_args = "-plaintext"
    if tls:
        client_args += ", tls=TlsOptions(open('ca.pem', 'rb').read())"
        grpcurl_args = "-cacert ca.pem"
    if token:
        client_args += ", token=open('token').read().strip()"
        grpcurl_args += ' -H "authorization: Bearer $(cat token)"'
    imports = "LookupClient, TlsOptions" if tls else "LookupClient"
    title, proto_flags, body = _grpcurl_query(feature)
    return (
        "example query (Python client):\n"
        f'  python -c "from ibpembed_client import {imports}; '
        f"print(LookupClient({client_args}).lookup({{'{feature}': [[1, 2]]}})['{feature}'])\"\n"
        f"example query ({title}):\n"
        f"  grpcurl {grpcurl_args}{proto_flags} -d '{body}' {target} {SERVICE_NAME}/Lookup"
    )


def _tier_line(engine: LookupEngine, raw: int, stored: int) -> str:
    """The hot tier's budget and the savings left net of it (nothing when there is none)."""
    if engine.tier is None:
        return ""
    plans = engine.tier.plan().values()
    rows = sum(p.bytes for p in plans)
    state = sum(p.state_bytes for p in plans)
    return (
        f"hot tier {engine.tier.budget.describe()}: up to {rows:,} bytes of decoded rows and "
        f"{state:,} of admission state, {1 - (stored + rows + state) / max(raw, 1):.1%} saved "
        "net of both\n"
    )


def _hbm_tier_line(engine: LookupEngine) -> str:
    """The HBM tier's budget (nothing when there is none: off, or not on a GPU)."""
    if engine.hbm is None:
        return ""
    tier = sum(p.bytes for p in engine.hbm.plan().values())
    return (
        f"hbm tier {engine.hbm.budget.describe()} ({engine.hbm.form}): up to {tier:,} bytes of "
        "GPU memory\n"
    )


def _reload_line(config: ServerConfig) -> str:
    when = f"when its manifest changes (checked every {config.reload_poll_s:g} s) and "
    return f"table set reloads {when if config.reload_poll_s else ''}on SIGHUP\n"


async def _shut_down_unloaded(server: LookupServer, metrics: ServerMetrics | None) -> None:
    """Stop a server whose tables never came to be served (no RPC was admitted)."""
    await server.stop(0)
    if metrics is not None:
        metrics.stop_http_server()


class _LoadProgress:
    """Tables loaded so far, to the console and to the loading gauge (called by the load thread):
    a multi-minute load otherwise prints nothing between "bound" and "listening"."""

    def __init__(self, out: TextIO, metrics: ServerMetrics | None) -> None:
        self._out, self._metrics = out, metrics
        self._start = time.monotonic()
        self._last = -_PROGRESS_EVERY_S

    def __call__(self, done: int, total: int) -> None:
        if self._metrics is not None:
            self._metrics.loading_progress(done, total)
        elapsed = time.monotonic() - self._start
        if done == total or elapsed - self._last >= _PROGRESS_EVERY_S:
            self._last = elapsed
            print(f"loading: {done}/{total} tables ({elapsed:.1f} s)", file=self._out, flush=True)


async def serve(config: ServerConfig, *, out: TextIO = sys.stdout) -> int:
    """Run until SIGTERM/SIGINT, then drain and return 0 (also when the signal comes while the
    tables load: nothing is in flight then, and the load is abandoned)."""
    if config.tables is not None and not Path(config.tables).is_dir():
        # Said before binding: the load would only find no manifest, after "bound ...".
        what = "not a directory" if Path(config.tables).exists() else "no such directory"
        raise ValueError(f"{config.tables}: {what}")
    # Process-wide, hence here and not in LookupServer (see ServerConfig.torch_threads).
    torch.set_num_threads(config.torch_threads)
    # A table file shortened in place under the server costs its lookups, not the process.
    mapping_guard.enable()
    keep_freed_memory(config.malloc_retain_mb)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    metrics = ServerMetrics(device=config.device) if config.metrics_port else None
    server = LookupServer(config, observer=metrics)
    metrics_port = 0
    try:
        if metrics is not None:
            metrics_port = metrics.start_http_server(
                config.host, config.metrics_port, ready=lambda: server.state.accepting
            )
        port = await server.start()
    except BaseException:
        if metrics is not None:
            metrics.stop_http_server()
        raise
    scheme = "TLS" if config.tls_cert else "plaintext"
    print(
        f"bound {config.host}:{port} ({scheme}); health NOT_SERVING while the tables load\n"
        + (f"metrics on http://{config.host}:{metrics_port}/metrics\n" if metrics else ""),
        end="",
        file=out,
        flush=True,
    )
    log.info("loading %s", config.tables or "the embedded demo table set")
    loading = in_daemon_thread(
        lambda: load_and_check(config, _LoadProgress(out, metrics)),
        name=LOAD_THREAD,
    )
    loop.add_signal_handler(signal.SIGHUP, server.request_reload)
    stopping = loop.create_task(stop.wait())
    try:
        # Futures of different results: no common type but Any.
        either: set[asyncio.Future[Any]] = {loading, stopping}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            store, device = loading.result()  # a table set that does not load raises here
    except BaseException:
        await _shut_down_unloaded(server, metrics)
        raise
    finally:
        stopping.cancel()
    if not loading.done():
        log.warning("%s while loading the tables: exiting without serving", received[0])
        loading.cancel()  # abandoned: the load thread is a daemon
        await _shut_down_unloaded(server, metrics)
        return 0
    try:
        if metrics is not None:
            metrics.attach(store, device=device)
        await server.serve_tables(store, device)
    except BaseException:
        # Stopped here, on the loop that runs it: a gRPC server left to the garbage collector
        # schedules its shutdown on a closed loop (RuntimeError noise after the real error).
        await _shut_down_unloaded(server, metrics)
        raise
    assert server.engine is not None
    if metrics is not None and server.engine.tier is not None:
        metrics.watch_hot_tier(server.engine.tier)
    if metrics is not None and server.engine.hbm is not None:
        metrics.watch_hbm_tier(server.engine.hbm)
    tables = server.engine.describe()
    first_feature = next((t.features[0] for t in tables if t.features), None)
    source = config.tables or f"embedded demo ({len(tables)} DLRM-DCNv2-profile tables)"
    raw = sum(t.raw_bytes for t in tables)
    stored = sum(t.stored_bytes for t in tables)
    # An empty set (a shard that holds no rows) saves nothing and has nothing to query.
    saved = f"{1 - stored / raw:.1%} saved" if raw else "no rows"
    query = (
        "no feature to query yet: a reload that adds tables serves them\n"
        if first_feature is None
        else example_query(
            config.host,
            port,
            first_feature,
            tls=config.tls_cert is not None,
            token=server.identities.enabled,
        )
    )
    print(
        f"ibpembed serving {source} on {server.engine.device}: {len(tables)} tables, "
        f"{raw:,} raw bytes stored in {stored:,} ({saved}), "
        f"version {server.engine.store.version}\n"
        + _tier_line(server.engine, raw, stored)
        + _hbm_tier_line(server.engine)
        + f"listening on {config.host}:{port} ({scheme})\n"
        + (_reload_line(config) if config.tables else "")
        + query,
        file=out,
        flush=True,
    )
    await stop.wait()
    log.info("%s received: draining (grace %.1f s)", received[0], config.grace_s)
    await server.stop()
    if metrics is not None:
        metrics.stop_http_server()
    log.info("stopped")
    return 0
