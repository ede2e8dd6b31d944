# SPDX-License-Identifier: Apache-2.0
"""How many LookupStream requests may be read and not yet answered, per caller and in all.

A stream request holds a place from when the server reads it until its response has been
written: while its kernels run, and while the computed response waits for the client to take it
(HTTP/2 flow control keeps it in the server for as long as the client does not read). The places
bound the memory such responses hold; they are not the engine's admission slots, which a
response leaves once its kernels finish, so streams that nobody reads cannot refuse anyone else's
lookups. A caller (its identity, whatever connections it opens; on a server without tokens, where
every caller is anonymous, its connection) holds at most its share of the places, so stalled
streams of one caller leave the others room; a stream that cannot take a place stops
reading (flow control pushes back on its client) until one frees. The write timeout of the
interceptor ends a stream whose responses nobody takes, and with it the places it holds.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable


class StreamBacklog:
    """Places for stream requests read and not yet answered.

    Parameters
    ----------
    total : places of all streams together.
    share : places one caller's streams hold at most (at most ``total``).
    """

    def __init__(self, total: int, share: int) -> None:
        if total < 1 or not 1 <= share <= total:
            raise ValueError(f"need 1 <= share <= total, got share {share}, total {total}")
        self.total = total
        self.share = share
        self._held: collections.Counter[Hashable] = collections.Counter()
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def for_server(cls, max_inflight: int, stream_window: int) -> StreamBacklog:
        """The server's backlog: ``max_inflight`` places in all (the memory their responses
        hold), half of them per caller so that stalled streams leave others room, and at least
        one stream's window so that a caller's one stream can fill it."""
        return cls(max_inflight, min(max_inflight, max(stream_window, max_inflight // 2)))

    @property
    def held(self) -> int:
        return self._held.total()

    async def acquire(self, caller: Hashable) -> None:
        """Take a place for ``caller``, waiting while it holds its share or all are taken."""
        while self._held[caller] >= self.share or self._held.total() >= self.total:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        self._held[caller] += 1

    def release(self, caller: Hashable) -> None:
        """Give back a place ``caller`` took (on the event loop's thread); every waiter looks
        again (few: one per stream waiting)."""
        self._held[caller] -= 1
        if not self._held[caller]:
            del self._held[caller]
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
