# SPDX-License-Identifier: Apache-2.0
"""Overload from one caller stays that caller's: streams nobody reads, refused large requests and
requests naming absurd numbers of features, each against a real server."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ibpembed.server.servicer import EmbeddingLookupServicer
from ibpembed_client import LookupClient, RetryPolicy, build_request
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.engine.helpers import make_store
from tools.hostile import feature_names_request
from tools.serve_process import ServerProcess

from .helpers import RunningServer

STREAM = "/ibpembed.v1.EmbeddingLookup/LookupStream"


def _wait_for(condition, timeout: float = 30.0) -> bool:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _stalled_streams(
    target: str, streams: int, requests: int, token: str | None = None
) -> tuple[grpc.Channel, list]:
    """``streams`` LookupStreams on one connection, each sending ``requests`` requests whose
    1 MB responses it never reads: past the first, each waits on HTTP/2 flow control.
    ``token``: the bearer token they are sent with."""
    channel = grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.http2.bdp_probe", 0),  # the receive window stays at its 64 KiB
            # A connection of its own: channels of one process otherwise share theirs.
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )
    call = channel.stream_stream(
        STREAM,
        request_serializer=pb.LookupRequest.SerializeToString,
        response_deserializer=pb.LookupResponse.FromString,
    )
    rows = [[i % 1000 for i in range(16_000)]]  # 16,000 NONE rows of 64 bytes
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    started = [
        call(
            iter([build_request({"user": rows}, "none", f"s{s}-{k}") for k in range(requests)]),
            metadata=metadata,
        )
        for s in range(streams)
    ]
    return channel, started


def test_a_fresh_client_is_served_while_eight_stalled_streams_stay_open():
    settings = {"max_inflight": 16, "stream_window": 2, "stream_write_timeout_s": 4.0}
    with RunningServer(make_store(), **settings) as running:
        backlog = running.server.servicer.backlog
        channel, stalled = _stalled_streams(running.target, streams=8, requests=6)
        try:
            # The stalled caller fills its share of the backlog (half of it) and stops there;
            # once their kernels are done, its unwritten responses hold no admission slot.
            engine = running.server.engine
            assert _wait_for(lambda: backlog.held == backlog.share and engine.inflight == 0)
            with LookupClient(
                running.target, timeout=30, retry=RetryPolicy(max_attempts=1)
            ) as fresh:
                for _ in range(20):
                    assert fresh.lookup({"user": [[1, 2]]})["user"].shape == (1, 16)
                streamed = list(
                    fresh.lookup_stream([build_request({"user": [[3]]}) for _ in range(10)])
                )
                assert [r["user"].shape for r in streamed] == [(1, 16)] * 10
            # Nobody takes the stalled responses: the write timeout ends those streams and
            # frees their places.
            assert _wait_for(lambda: backlog.held == 0 and running.server.state.active == 0)
        finally:
            for call in stalled:
                call.cancel()
            channel.close()


def test_a_second_connection_does_not_widen_an_identitys_share(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("fe-a token-a\nfe-b token-b\n")
    settings = {"max_inflight": 16, "stream_window": 2, "stream_write_timeout_s": 60.0}
    with RunningServer(make_store(), auth_tokens_file=str(tokens), **settings) as running:
        backlog = running.server.servicer.backlog
        # fe-a's share (8) on its first connection: 4 stalled streams of 2 requests each.
        opened = [_stalled_streams(running.target, streams=4, requests=2, token="token-a")]
        try:
            assert _wait_for(lambda: backlog.held == backlog.share)
            # A second connection of fe-a: its stream's first request waits for a place of
            # fe-a's instead of taking one of the places left to others.
            opened.append(_stalled_streams(running.target, streams=1, requests=2, token="token-a"))
            assert _wait_for(lambda: len(backlog._waiters) == 1), backlog.held
            assert backlog.held == backlog.share
            with LookupClient(
                running.target, token="token-b", timeout=30, retry=RetryPolicy(max_attempts=1)
            ) as other:
                streamed = list(other.lookup_stream([build_request({"user": [[3]]})] * 10))
                assert [r["user"].shape for r in streamed] == [(1, 16)] * 10
        finally:
            for channel, calls in opened:
                for call in calls:
                    call.cancel()
                channel.close()
        assert _wait_for(lambda: backlog.held == 0 and not backlog._waiters)


def test_a_timed_out_stream_frees_its_places_before_its_handler_is_collected(monkeypatch):
    """The write timeout gives back a stream's backlog places as the RPC ends, not when
    garbage collection finalizes its handler: here every handler is kept alive."""
    handlers = []  # the LookupStream generators, referenced until the test ends
    lookup_stream = EmbeddingLookupServicer.LookupStream

    def kept(self, request_iterator, context):
        handlers.append(lookup_stream(self, request_iterator, context))
        return handlers[-1]

    monkeypatch.setattr(EmbeddingLookupServicer, "LookupStream", kept)
    settings = {"stream_window": 2, "stream_write_timeout_s": 0.5}
    with RunningServer(make_store(), **settings) as running:
        backlog = running.server.servicer.backlog
        channel, stalled = _stalled_streams(running.target, streams=1, requests=6)
        try:
            assert _wait_for(lambda: handlers and running.server.state.active == 0)
            assert _wait_for(lambda: backlog.held == 0, timeout=5.0), backlog.held
        finally:
            for call in stalled:
                call.cancel()
            channel.close()


@pytest.mark.parametrize("window", [1, 3])
def test_a_stream_that_reads_is_never_ended_by_the_write_timeout(window):
    settings = {"stream_window": window, "stream_write_timeout_s": 0.5}
    with (
        RunningServer(make_store(), **settings) as running,
        LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as client,
    ):
        requests = [build_request({"user": [[i % 1000]]}, request_id=f"r{i}") for i in range(50)]
        got = [r.request_id for r in client.lookup_stream(requests)]
        assert got == [f"r{i}" for i in range(50)]
        assert running.server.servicer.backlog.held == 0


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (feature_names_request(1_000_000), "features"),  # more than served: refused by count
        (b"".join([feature_names_request(2)] * 2), "features[2].name"),  # a repeat
    ],
    ids=["a-million-features", "repeated"],
)
def test_requests_that_cannot_be_valid_are_refused_before_per_feature_work(message, field):
    with RunningServer(make_store()) as running:
        call = grpc.insecure_channel(running.target).unary_unary(
            "/ibpembed.v1.EmbeddingLookup/Lookup"
        )
        with pytest.raises(grpc.RpcError) as err:
            call(message, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
        with LookupClient(running.target, timeout=30) as client:  # still serving
            assert client.lookup({"user": [[1]]})["user"].shape == (1, 16)


def test_refused_large_requests_do_not_accumulate_in_the_server_process():
    """Refused 60 MiB requests (ids out of range, an unknown feature) against `ibpembed serve`:
    its RSS stays within 768 MiB of what it was before them. When the refusal's exception kept
    the request's buffers in a reference cycle until a full GC, each added ~180 MiB."""
    count = (60 << 20) // 8
    requests = []
    for name, first_id in (("cat_0", 10**9), ("no-such-feature", 1)):
        request = pb.LookupRequest()
        feature = request.features.add(name=name)
        feature.ids = np.full(count, first_id, dtype="<i8").tobytes()
        feature.lengths = np.array([count], "<i4").tobytes()
        requests.append(request.SerializeToString())
    with ServerProcess("--demo-max-rows", "300", "--workers", "1") as server:
        channel = grpc.insecure_channel(
            server.target, options=[("grpc.max_send_message_length", 128 << 20)]
        )
        call = channel.unary_unary("/ibpembed.v1.EmbeddingLookup/Lookup")
        before = server.rss()
        peak = before
        for _ in range(8):
            for request in requests:
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=120)
                assert err.value.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND,
                )
                peak = max(peak, server.rss())
        channel.close()
        assert peak - before < 768 << 20, f"RSS {before >> 20} -> {peak >> 20} MiB"
