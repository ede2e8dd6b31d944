# SPDX-License-Identifier: Apache-2.0
"""A real server on a free loopback port (in a background event loop, or ``ibpembed serve`` as a
process). The small test tables and the observers are in tests.engine.helpers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from ibpembed.engine import KernelCall
from ibpembed.server.app import LookupServer, ServerObserver
from ibpembed.server.config import ServerConfig
from ibpembed.tables.store import TableStore
from tests.engine.helpers import RecordingObserver

T = TypeVar("T")


class RunningServer:
    """A :class:`LookupServer` serving on 127.0.0.1:<free port> from a background thread.

    Parameters
    ----------
    store : the tables.
    observer : the server's metrics hook (tests use it to hold requests inside a kernel call).
    settings : :class:`ServerConfig` fields (port is always 0).
    """

    def __init__(
        self, store: TableStore, *, observer: ServerObserver | None = None, **settings: Any
    ) -> None:
        settings.setdefault("workers", 2)
        # No background hot-row refreshes unless a test asks: sizes must not change under it.
        settings.setdefault("hot_tier", "off")
        if getattr(observer, "holds_kernels", False):
            # A gate holds requests inside their kernels: on worker threads, as small requests
            # run inline on the event loop otherwise, which the gate would then hold.
            settings.setdefault("inline_max_ids", 0)
        self.config = ServerConfig(port=0, **settings).validate()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> LookupServer:
            server = LookupServer(self.config, store, observer=observer)
            await server.start()
            return server

        self.server = self.run(start())
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.close_loop()

    def close_loop(self) -> None:
        """End the background loop (for tests that stopped the server themselves)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FailingObserver(RecordingObserver):
    """Raises inside the engine: a stand-in for a server bug, to exercise INTERNAL."""

    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        raise RuntimeError("observer exploded")


# ``ibpembed serve`` flags for the small demo (300 rows a table): a server up in seconds.
DEMO_300 = ("--demo-max-rows", "300")
