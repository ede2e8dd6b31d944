# SPDX-License-Identifier: Apache-2.0
"""Metrics of a real gRPC server, scraped over real HTTP and parsed with prometheus_client.

Every value is checked against what the test sent; ``promtool check metrics`` lints the
exposition.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client import generate_latest

import ibpembed
from ibpembed.codec import compress
from ibpembed.server.metrics import LATENCY_BUCKETS_S, STREAM_METHOD, ServerMetrics
from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, build_request
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.engine.helpers import make_store
from tests.metrics.helpers import PROMTOOL, fetch, needs_promtool, parse, value
from tests.server.helpers import RunningServer

F32_ROW = 16 * 4  # emb_f32: D=16 fp32 (features user, user_hist)
BF16_ROW = 8 * 2  # emb_bf16: D=8 bf16 (feature item)
F16_ROW = 3 * 2  # emb_f16: D=3 fp16 (feature ctx)
# Values a request carries that must never become label values.
SECRET_FEATURE = "no_such_feature_7f3a"
SECRET_ID = 987_654_321


class Served:
    """A server with metrics on a free port, and a client to it."""

    def __init__(self, metrics_class: type[ServerMetrics] = ServerMetrics) -> None:
        self.store = make_store()
        self.metrics = metrics_class(self.store, device="cpu")
        self.running = RunningServer(self.store, observer=self.metrics)
        self.port = self.metrics.start_http_server("127.0.0.1", 0)
        self.client = LookupClient(
            self.running.target, timeout=30, retry=RetryPolicy(max_attempts=1)
        )

    def text(self) -> str:
        return fetch(f"http://127.0.0.1:{self.port}/metrics")

    def scrape(self) -> dict:
        return parse(self.text())

    def close(self) -> None:
        self.client.close()
        self.running.stop()
        self.metrics.stop_http_server()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def test_values_match_what_was_sent(served):
    client = served.client
    for _ in range(3):  # 3 SUM lookups: 3 emb_f32 ids + 1 emb_bf16 id each
        client.lookup({"user": [[1, 2], [3]], "item": [[4]]}, pooling="sum")
    client.lookup({"user": [[5, 5, 6]]}, pooling="none")  # 3 ids, 2 distinct rows decoded
    client.lookup({"ctx": [[1, 2, 3], []]}, pooling="mean")
    with pytest.raises(LookupServiceError) as not_found:
        client.lookup({SECRET_FEATURE: [[1]]})
    assert not_found.value.code.name == "NOT_FOUND"
    with pytest.raises(LookupServiceError) as out_of_range:
        client.lookup({"user": [[SECRET_ID]]})
    assert out_of_range.value.code.name == "INVALID_ARGUMENT"
    stream = [
        build_request({"item": [[1, 2]]}, "none"),
        build_request({SECRET_FEATURE: [[1]]}, "sum"),
        build_request({"item": [[3], [4, 5]]}, "sum"),
    ]
    errors = [r.error is not None for r in client.lookup_stream(stream)]
    assert errors == [False, True, False]
    client.list_tables()

    s = served.scrape()
    requests = "ibpembed_requests_total"
    assert value(s, requests, method="Lookup", code="OK") == 5
    assert value(s, requests, method="Lookup", code="NOT_FOUND") == 1
    assert value(s, requests, method="Lookup", code="INVALID_ARGUMENT") == 1
    assert value(s, requests, method="LookupStream", code="OK") == 2
    assert value(s, requests, method="LookupStream", code="NOT_FOUND") == 1
    assert value(s, requests, method="ListTables", code="OK") == 1

    count = "ibpembed_lookup_duration_seconds_count"
    assert value(s, count, method="Lookup", pooling="sum") == 5  # 3 OK + the 2 failures
    assert value(s, count, method="Lookup", pooling="none") == 1
    assert value(s, count, method="Lookup", pooling="mean") == 1
    assert value(s, count, method="LookupStream", pooling="none") == 1
    assert value(s, count, method="LookupStream", pooling="sum") == 2
    # Buckets are cumulative and end in +Inf == count; the first bound is 25 us.
    bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in s
        if name == "ibpembed_lookup_duration_seconds_bucket"
        and ("pooling", "sum") in labels
        and ("method", "Lookup") in labels
    )
    assert bounds == sorted([*LATENCY_BUCKETS_S, float("inf")])
    assert bounds[0] == 25e-6
    inf = value(
        s, "ibpembed_lookup_duration_seconds_bucket", method="Lookup", pooling="sum", le="+Inf"
    )
    assert inf == 5

    rows = "ibpembed_rows_looked_up_total"
    assert value(s, rows, table="emb_f32", pooling="sum") == 9
    assert value(s, rows, table="emb_bf16", pooling="sum") == 3 + 3  # unary + stream
    assert value(s, rows, table="emb_f32", pooling="none") == 3
    assert value(s, rows, table="emb_bf16", pooling="none") == 2
    assert value(s, rows, table="emb_f16", pooling="mean") == 3
    # Small pooled lookups decode every id; NONE decodes each distinct row once.
    decoded = "ibpembed_decoded_bytes_total"
    assert value(s, decoded, table="emb_f32") == (9 + 2) * F32_ROW
    assert value(s, decoded, table="emb_bf16") == (6 + 2) * BF16_ROW
    assert value(s, decoded, table="emb_f16") == 3 * F16_ROW
    kernel_calls = sum(
        v for (name, _), v in s.items() if name == "ibpembed_kernel_duration_seconds_count"
    )
    assert kernel_calls == 3 * 2 + 1 + 1 + 2  # one call per table per request
    assert value(s, "ibpembed_inflight_requests") == 0
    # Every lookup request is decoded (the unknown feature and the bad id are refused after);
    # only answered ones are encoded.
    wire = "ibpembed_wire_duration_seconds_count"
    assert value(s, wire, phase="decode") == 7 + 3
    assert value(s, wire, phase="encode") == 7
    assert value(s, "ibpembed_wire_duration_seconds_sum", phase="encode") > 0

    info = value(
        s,
        "ibpembed_build_info",
        version=ibpembed.__version__,
        device="cpu",
        cpu_path=ibpembed.cpu_path(),
        pattern_lookup=ibpembed.codec.pattern_lookup(),
        torch=torch.__version__,
    )
    assert info == 1


def test_no_request_values_in_labels(served):
    """Feature names, ids and request ids sent by clients never reach the exposition."""
    for i in range(20):
        with pytest.raises(LookupServiceError):
            served.client.lookup({f"{SECRET_FEATURE}_{i}": [[SECRET_ID + i]]})
    served.client.lookup({"user": [[SECRET_ID % 1000]]}, request_id="req-5ec2e7")
    text = served.text()
    for needle in (SECRET_FEATURE, str(SECRET_ID), "req-5ec2e7"):
        assert needle not in text
    labels = {k for (_, labels) in served.scrape() for k, _ in labels}
    assert labels == {"version", "device", "cpu_path", "pattern_lookup", "torch", "method"} | {
        "code",
        "pooling",
        "le",
        "table",
        "result",
        "transport",
        "phase",
    }


def test_table_gauges_follow_the_store(served):
    store = served.store
    s = served.scrape()
    for name, sizes in store.accounting().items():
        assert value(s, "ibpembed_table_raw_bytes", table=name) == sizes.raw
        assert value(s, "ibpembed_table_stored_bytes", table=name) == sizes.total
        assert value(s, "ibpembed_table_saved_bytes", table=name) == sizes.raw - sizes.total
        assert value(s, "ibpembed_table_compression_ratio", table=name) == pytest.approx(
            sizes.ratio
        )
        assert value(s, "ibpembed_table_version", table=name) == 1
        assert value(s, "ibpembed_table_reloads_total", table=name) == 0
    assert value(s, "ibpembed_table_raw_bytes", table="emb_f32") == 1000 * F32_ROW

    bigger = (torch.randn(700, 3, generator=torch.Generator().manual_seed(1)) * 0.05).half()
    store.put_table("emb_f16", compress(bigger))
    served.client.lookup({"ctx": [[1]]})  # noticed at the first lookup after a publication
    cached = store.set_hot_rows("emb_bf16", torch.arange(0, 500, 2))  # same rows: no reload
    store.update_rows("emb_f32", torch.tensor([0]), torch.ones(1, 16))
    s = served.scrape()
    hot = store.accounting()["emb_bf16"].hot
    assert cached > 0 and hot >= cached * BF16_ROW
    assert value(s, "ibpembed_table_hot_row_bytes", table="emb_bf16") == hot
    assert value(s, "ibpembed_table_hot_row_bytes", table="emb_f32") == 0
    assert value(s, "ibpembed_table_raw_bytes", table="emb_f16") == 700 * F16_ROW
    assert value(s, "ibpembed_table_version", table="emb_f16") == 3
    assert value(s, "ibpembed_table_reloads_total", table="emb_f16") == 1
    assert value(s, "ibpembed_table_reloads_total", table="emb_f32") == 1
    assert value(s, "ibpembed_table_reloads_total", table="emb_bf16") == 0


class GatedMetrics(ServerMetrics):
    """Holds kernel calls until released, so the test knows what is in flight."""

    holds_kernels = True  # on worker threads (see RunningServer)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def kernels_done(self, *args: object) -> None:
        super().kernels_done(*args)
        self.entered.release()
        self.gate.wait(timeout=60)


def test_inflight_counts_unary_and_stream_requests():
    served = Served(GatedMetrics)
    metrics = served.metrics
    try:
        with ThreadPoolExecutor(2) as pool:
            unary = pool.submit(served.client.lookup, {"user": [[1]]})
            stream = pool.submit(
                lambda: list(served.client.lookup_stream([build_request({"item": [[1]]}, "sum")]))
            )
            for _ in range(2):
                assert metrics.entered.acquire(timeout=30)
            assert value(served.scrape(), "ibpembed_inflight_requests") == 2
            metrics.gate.set()
            unary.result(timeout=30)
            stream.result(timeout=30)
        assert value(served.scrape(), "ibpembed_inflight_requests") == 0
    finally:
        metrics.gate.set()
        served.close()


def test_a_cancelled_stream_leaves_nothing_in_flight():
    """Requests of a LookupStream the client cancels before they are answered stop counting as
    in flight when the stream ends."""
    served = Served(GatedMetrics)
    metrics = served.metrics
    try:
        with grpc.insecure_channel(served.running.target) as channel:
            call = channel.stream_stream(
                STREAM_METHOD,
                request_serializer=pb.LookupRequest.SerializeToString,
                response_deserializer=pb.LookupResponse.FromString,
            )(iter([build_request({"item": [[1]]}, "sum"), build_request({"item": [[2]]}, "sum")]))
            assert metrics.entered.acquire(timeout=30)  # the first request is in its kernel
            assert value(served.scrape(), "ibpembed_inflight_requests") >= 1
            call.cancel()
        metrics.gate.set()
        waited = time.monotonic() + 30
        while value(served.scrape(), "ibpembed_inflight_requests") and time.monotonic() < waited:
            time.sleep(0.05)
        assert value(served.scrape(), "ibpembed_inflight_requests") == 0
    finally:
        metrics.gate.set()
        served.close()


@needs_promtool
def test_promtool_check_metrics(served):
    served.client.lookup({"user": [[1, 2]], "item": [[3]]})
    served.client.lookup({"ctx": [[1]]}, pooling="none")
    text = served.text()
    assert "ibpembed_lookup_duration_seconds_bucket" in text
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout


def test_kernel_tallies_of_many_threads_add_up():
    """Worker threads update without a lock; scrapes meanwhile see consistent, growing totals."""
    metrics = ServerMetrics(make_store(), device="cpu")
    threads, calls = 4, 3000
    stop = threading.Event()
    seen: list[float] = []

    def scrape_until_stopped() -> None:
        while not stop.is_set():
            text = generate_latest(metrics.registry).decode()
            seen.append(
                value(parse(text), "ibpembed_rows_looked_up_total", table="emb_f32", pooling="sum")
            )

    def work(worker: int) -> None:
        for i in range(calls):
            metrics.kernels_done("sum", [("emb_f32", 3, 2, (i % 7) * 1e-4)])
            metrics.kernels_done("none", [("emb_f16", 1, 1, 2e-5)])

    scraper = threading.Thread(target=scrape_until_stopped)
    scraper.start()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    stop.set()
    scraper.join(timeout=60)
    assert seen == sorted(seen)  # counters never go backwards
    s = parse(generate_latest(metrics.registry).decode())
    n = threads * calls
    assert value(s, "ibpembed_rows_looked_up_total", table="emb_f32", pooling="sum") == 3 * n
    assert value(s, "ibpembed_decoded_bytes_total", table="emb_f32") == 2 * n * F32_ROW
    assert value(s, "ibpembed_decoded_bytes_total", table="emb_f16") == n * F16_ROW
    assert value(s, "ibpembed_kernel_duration_seconds_count", pooling="sum") == n
    assert value(s, "ibpembed_kernel_duration_seconds_bucket", pooling="none", le="2.5e-05") == n
    # 0 and 1e-4 (i % 7 in {0, 1}) fall at or below the 100 us bound; 2e-4 and up do not.
    below = sum(1 for i in range(calls) if i % 7 <= 1) * threads
    assert value(s, "ibpembed_kernel_duration_seconds_bucket", pooling="sum", le="0.0001") == below


def test_stream_with_an_undecodable_message(served):
    """A LookupStream message that does not parse is one INVALID_ARGUMENT request, pooling
    ``invalid``; the stream and its metrics go on."""
    with grpc.insecure_channel(served.running.target) as channel:
        call = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=lambda raw: raw,
            response_deserializer=pb.LookupResponse.FromString,
        )
        messages = [
            build_request({"item": [[1]]}, "sum").SerializeToString(),
            b"\x0a\xff",  # field 1 with a truncated length: not a message
            build_request({"item": [[2, 3]]}, "none").SerializeToString(),
        ]
        codes = [r.error.code if r.HasField("error") else 0 for r in call(iter(messages))]
    assert codes == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    s = served.scrape()
    requests = "ibpembed_requests_total"
    assert value(s, requests, method="LookupStream", code="OK") == 2
    assert value(s, requests, method="LookupStream", code="INVALID_ARGUMENT") == 1
    count = "ibpembed_lookup_duration_seconds_count"
    assert value(s, count, method="LookupStream", pooling="invalid") == 1
    assert value(s, count, method="LookupStream", pooling="sum") == 1
    assert value(s, count, method="LookupStream", pooling="none") == 1
    assert value(s, "ibpembed_inflight_requests") == 0


@pytest.mark.parametrize(("path", "status"), [("/metrics", 200), ("/healthz", 200), ("/no", 404)])
def test_head_answers_as_get_without_the_body(served, path, status):
    url = f"http://127.0.0.1:{served.port}{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as r:
            got, headers, body = r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        got, headers, body = exc.code, exc.headers, exc.read()
    assert got == status and body == b""
    assert headers["Content-Type"].startswith("text/plain")
    assert int(headers["Content-Length"]) > 0  # the body GET would have sent


def test_metrics_port_in_use_names_the_port():
    metrics = ServerMetrics(make_store(), device="cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as raised:
            metrics.start_http_server("127.0.0.1", port)
    # Worded as the gRPC port's error, without the "[Errno 98]" of str(OSError(errno, text)).
    assert str(raised.value) == (
        f"cannot listen on 127.0.0.1:{port} (metrics): the port is in use"
        " (by another server: another `ibpembed serve`?)"
    )
