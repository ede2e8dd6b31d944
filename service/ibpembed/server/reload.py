# SPDX-License-Identifier: Apache-2.0
"""Live reloads of the served table set: on SIGHUP, and when its manifest changes.

``TableStore.reload`` does the work: it loads the whole set off to the side and publishes it with
one pointer swap, all or nothing, so a lookup sees the old version or the new one, never a mix,
and tables whose files did not change are kept as they are. This module decides when to call it,
runs it off the event loop, and reports what happened.

When. ``ibpembed pack`` publishes a set by replacing its ``manifest.json`` last, atomically, so a
change of the manifest's identity (inode, mtime, size) is the signal. The watcher polls it every
``reload_poll_s`` seconds; SIGHUP reloads at once. Each poll also looks for served table files
changed in place (``TableStore.check_files``) and withdraws their tables. The first poll always
loads: the set may have changed between the server's start-up load and the watcher's start, and
a reload that finds the set unchanged publishes nothing.

Failures (a corrupt or truncated file, a manifest naming a missing table, a file swept by a
concurrent pack, no memory to pin a table) keep the previous version serving: the error is
logged, counted (``ibpembed_table_set_reloads_total{result="error"}``) and raised as
``ibpembed_table_set_reload_failing`` until a reload succeeds. A set the loader rejects is tried
again by the watcher only once its manifest changes (the same bytes would fail the same way);
other failures (I/O, memory) are retried at the next poll; SIGHUP always tries. Nothing else
ends the watcher either: an unexpected error in one of its checks is logged and it keeps watching.

Stopping. A reload runs in a daemon thread, so a server that cannot wait for one (its shutdown
grace period ran out) abandons it and exits without joining the thread. Abandoning is harmless:
a reload only reads files, and ``TableStore.reload`` publishes the whole new set with one pointer
swap or nothing, so a set is never half published; a set published after the server stopped is
served by nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from ibpembed.tables.manifest import MANIFEST
from ibpembed.tables.store import TableStore

log = logging.getLogger(__name__)

T = TypeVar("T")
ReloadResult = Literal["ok", "unchanged", "error"]
RELOAD_RESULTS: tuple[ReloadResult, ...] = ("ok", "unchanged", "error")

# (inode, mtime ns, size) of the manifest; None when it cannot be read.
_Stamp = tuple[int, int, int] | None


class ReloadObserver(Protocol):
    """Optional hook for reload metrics, called on the event loop once per reload attempt."""

    def reload_done(self, result: ReloadResult) -> None:
        """A reload ``ok`` (published), ``unchanged`` (nothing to publish) or ``error``."""


def in_daemon_thread(fn: Callable[[], T], name: str = "ibpembed-reload") -> asyncio.Future[T]:
    """``fn()`` in a new daemon thread: unlike ``asyncio.to_thread`` (the loop's executor, joined
    by ``asyncio.run`` and at interpreter exit), a process may exit while it still runs."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: T | None, error: BaseException | None) -> None:
        if future.done():  # cancelled: the reload was abandoned
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)  # type: ignore[arg-type]

    def run() -> None:
        outcome, error = None, None
        try:
            outcome = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class TierRefresher(Protocol):
    def refresh(self, tables: Collection[str] | None = None) -> dict[str, int]: ...


@dataclass(frozen=True)
class ReloadOutcome:
    result: ReloadResult
    version: int  # serving after the attempt
    changed: tuple[str, ...] = ()  # tables whose rows were replaced, added or dropped
    error: str | None = None
    # The set itself is bad (the loader rejected it), not the moment: retrying cannot help.
    rejected: bool = False


class TableSetReloader:
    """Reloads ``store`` from its directory on request and when the manifest changes.

    Parameters
    ----------
    store : a store loaded from a table-set directory (``store.directory`` set).
    poll_s : seconds between manifest checks; 0 = reload on request (SIGHUP) only.
    tier : the engine's hot tier (``engine.tier.HotTier``); tables a reload replaced get their
        tier back at once rather than at its next refresh.
    observer : optional metrics hook.
    """

    def __init__(
        self,
        store: TableStore,
        *,
        poll_s: float,
        tier: TierRefresher | None = None,
        observer: ReloadObserver | None = None,
    ) -> None:
        if store.directory is None:
            raise ValueError("the store was not loaded from a table-set directory")
        if poll_s < 0:
            raise ValueError(f"poll_s must be >= 0, got {poll_s}")
        self.store = store
        self.poll_s = poll_s
        self.tier = tier
        self.observer = observer
        self._lock = asyncio.Lock()  # one reload at a time; SIGHUPs during one wait for it
        self._tried: _Stamp | Literal["never"] = "never"  # manifest the watcher last loaded
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def reloading(self) -> bool:
        """Whether a reload is in progress."""
        return self._lock.locked()

    def _stamp(self) -> _Stamp:
        assert self.store.directory is not None
        try:
            st = os.stat(self.store.directory / MANIFEST)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def reload(self, reason: str, *, log_unchanged: bool = True) -> ReloadOutcome | None:
        """Reload now (waiting for a reload in progress first); never raises for a bad set.
        None once :meth:`stop` has been called: a stopping server loads nothing new.

        ``log_unchanged``: log a reload that found nothing to publish at INFO (else DEBUG).
        """
        async with self._lock:
            if self._stopped:
                log.info("reload (%s) skipped: the server is stopping", reason)
                return None
            stamp = self._stamp()
            started = time.perf_counter()
            log.debug("reload of %s (%s) started", self.store.directory, reason)
            outcome = await in_daemon_thread(self._reload_blocking)
            if outcome.result != "error" or outcome.rejected:
                self._tried = stamp
        seconds = time.perf_counter() - started
        what = {
            "ok": f"version {outcome.version} published, tables changed: "
            + ", ".join(outcome.changed),
            "unchanged": f"nothing changed, version {outcome.version} serves",
            "error": f"failed, version {outcome.version} keeps serving: {outcome.error}",
        }[outcome.result]
        level = {"ok": logging.INFO, "error": logging.ERROR}.get(
            outcome.result, logging.INFO if log_unchanged else logging.DEBUG
        )
        log.log(level, "reload of %s (%s, %.2f s): %s", self.store.directory, reason, seconds, what)
        if self.observer is not None:
            try:
                self.observer.reload_done(outcome.result)
            except Exception:  # a metrics bug must not stop reloads (nor the watcher)
                log.exception("the reload metrics hook failed")
        return outcome

    def _reload_blocking(self) -> ReloadOutcome:
        # A table's index tensor names its rows: a tier refresh republishes the same one.
        with self.store.acquire() as before:
            old = {name: table.block_base for name, table in before.tables.items()}
        try:
            published = self.store.reload()
        except ValueError as exc:  # TableSetError, TableFileError: the set itself is bad
            return ReloadOutcome("error", self.store.version, error=str(exc), rejected=True)
        except RecursionError:  # JSON nested past Python's recursion limit: bad, not unlucky
            error = f"{MANIFEST} is nested too deeply to be a table-set manifest"
            return ReloadOutcome("error", self.store.version, error=error, rejected=True)
        except OSError as exc:  # I/O: may pass
            return ReloadOutcome("error", self.store.version, error=str(exc))
        except Exception as exc:  # e.g. out of memory, or a bug: keep serving, keep the traceback
            log.exception("reload failed unexpectedly")
            return ReloadOutcome("error", self.store.version, error=repr(exc))
        if not published:
            return ReloadOutcome("unchanged", self.store.version)
        with self.store.acquire() as after:
            version = after.version
            new = {name: table.block_base for name, table in after.tables.items()}
        changed = tuple(sorted(n for n in old.keys() | new.keys() if old.get(n) is not new.get(n)))
        # A stopping server (this reload may be abandoned) serves no tier any more.
        if self.tier is not None and changed and not self._stopped:
            try:
                self.tier.refresh([n for n in changed if n in new])
            except Exception:  # the tier comes back at its next periodic refresh
                log.exception("hot tier refresh after the reload failed")
        return ReloadOutcome("ok", version, changed)

    # -- the manifest watcher --------------------------------------------------------------------
    def start(self) -> None:
        """Start polling the manifest (on the running event loop); no-op when ``poll_s`` is 0."""
        if self.poll_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
            self._task.add_done_callback(_watcher_ended)

    async def _watch(self) -> None:
        while True:
            try:
                await self._check_files()
                await self._check()
            except Exception:  # one failed check must not end the watching
                log.exception(
                    "check of %s for a new manifest failed; watching on", self.store.directory
                )
            await asyncio.sleep(self.poll_s)

    async def _check_files(self) -> None:
        """Withdraw tables whose files were changed in place (``TableStore.check_files``)."""
        async with self._lock:  # not while a reload maps files
            if self._stopped:
                return
            withdrawn = await in_daemon_thread(self.store.check_files)
        for table, why in withdrawn.items():
            log.error(
                "table %s withdrawn, its lookups refused: %s. Publish table files with"
                " `ibpembed pack` (or copy to a new name and rename), then reload (SIGHUP)",
                table,
                why,
            )

    async def _check(self) -> None:
        if self._stamp() != self._tried:
            # The first check finds the set loaded at start-up unless a pack raced it.
            first = self._tried == "never"
            reason = "start-up check" if first else "manifest changed"
            await self.reload(reason, log_unchanged=not first)

    async def stop(self) -> None:
        """Stop polling and refuse later reloads; a reload in progress finishes first (cancel
        this and call :meth:`abandon` not to wait for it). Never raises for a watcher that
        failed: that was logged when it did."""
        self._stopped = True
        async with self._lock:  # waits for a reload in progress
            pass
        await self._end_watcher()

    async def abandon(self) -> None:
        """Stop without waiting: refuse later reloads and cancel the watcher, with any reload it
        awaits (that reload's thread runs on, see the module docstring)."""
        self._stopped = True
        await self._end_watcher()

    async def _end_watcher(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # Unlike awaiting the task, raises only if *we* are cancelled (its own end is logged).
        await asyncio.wait({task})


def _watcher_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the table-set watcher stopped: new manifests are no longer loaded (SIGHUP still"
            " reloads)",
            exc_info=task.exception(),
        )
