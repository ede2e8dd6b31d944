# SPDX-License-Identifier: Apache-2.0
"""The stream backlog: its sizing for a server's settings, and a caller past its share waiting
for its own place while another caller is served."""

from __future__ import annotations

import asyncio

import pytest

from ibpembed.server.backlog import StreamBacklog


@pytest.mark.parametrize(
    ("max_inflight", "stream_window", "share"),
    [(64, 8, 32), (64, 48, 48), (4, 8, 4), (1, 1, 1)],
)
def test_a_callers_share_is_half_at_least_a_window_at_most_all(max_inflight, stream_window, share):
    backlog = StreamBacklog.for_server(max_inflight, stream_window)
    assert (backlog.total, backlog.share) == (max_inflight, share)


@pytest.mark.parametrize(("total", "share"), [(0, 0), (4, 0), (4, 5)])
def test_impossible_sizes_are_refused(total, share):
    with pytest.raises(ValueError, match="share"):
        StreamBacklog(total, share)


def test_a_caller_past_its_share_waits_while_another_is_served():
    async def main() -> tuple[bool, bool, int]:
        backlog = StreamBacklog(total=3, share=2)
        await backlog.acquire("a")
        await backlog.acquire("a")
        third = asyncio.ensure_future(backlog.acquire("a"))
        await asyncio.sleep(0)
        waited = not third.done()
        await asyncio.wait_for(backlog.acquire("b"), 1)  # the place a cannot take
        backlog.release("a")
        await asyncio.wait_for(third, 1)
        backlog.release("b")
        for _ in range(2):
            backlog.release("a")
        return waited, third.done(), backlog.held

    assert asyncio.run(main()) == (True, True, 0)
