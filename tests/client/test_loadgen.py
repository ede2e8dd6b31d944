# SPDX-License-Identifier: Apache-2.0
"""The load generator against a real server, and its traffic model."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from ibpembed.tables.pack import pack_table_set
from ibpembed_client import loadgen
from ibpembed_client._histogram import LatencyHistogram
from ibpembed_client.workload import DCNV2_POOLING_FACTORS, ZipfIds, hotness_for, make_requests
from tests.engine.helpers import make_store
from tests.metrics.helpers import free_port
from tests.server.helpers import RunningServer
from tests.sharding.helpers import make_table_set
from tools.serve_process import ServerProcess


@pytest.fixture(scope="module")
def server():
    with RunningServer(make_store()) as running:
        yield running


@pytest.mark.parametrize("alpha", [1.0, 1.2])
def test_zipf_ids_are_skewed_in_range_and_permuted(alpha):
    sampler = ZipfIds(10_000, alpha, np.random.default_rng(0))
    ranks = sampler.ranks(50_000)
    counts = np.bincount(ranks, minlength=10_000)
    assert ranks.min() >= 0 and ranks.max() < 10_000
    assert counts[0] > counts[10] > counts[1000]  # popularity falls with rank
    ids = sampler.sample(50_000)
    assert ids.min() >= 0 and ids.max() < 10_000
    hottest = np.bincount(ids).argmax()
    assert hottest != 0  # hot rows are spread, not a prefix
    assert ZipfIds(1, alpha, np.random.default_rng(0)).sample(5).tolist() == [0] * 5


def test_requests_follow_the_dcnv2_profile():
    features = [f"cat_{i}" for i in range(26)]
    hot = hotness_for(features, "dcnv2")
    assert list(hot.values()) == list(DCNV2_POOLING_FACTORS) and sum(hot.values()) == 214
    (request,) = make_requests(
        dict.fromkeys(features, 50), batch_size=4, hotness=hot, alpha=1.05, pooling="sum", count=1
    )
    for feature, want in zip(request.features, DCNV2_POOLING_FACTORS, strict=True):
        assert np.frombuffer(feature.lengths, "<i4").tolist() == [want] * 4
    assert hotness_for(["a", "b"], "3") == {"a": 3, "b": 3}


@pytest.mark.parametrize(
    "mode", [{"concurrency": 4}, {"rate": 200.0, "max_inflight": 8}], ids=["closed", "open"]
)
def test_run_load_reports_without_errors(server, mode):
    cfg = loadgen.LoadConfig(
        target=server.target,
        duration_s=30.0,
        warmup_s=0.0,
        max_requests=40,
        batch_size=8,
        hotness="2",
        request_pool=4,
        progress=False,
        **mode,
    )
    report = asyncio.run(loadgen.run_load(cfg))
    assert report["errors"] == {} and report["ok"] + report["dropped"] >= 1
    assert report["ok"] == report["histogram_ms"]["count"] <= 40
    assert report["ok"] == sum(count for _, count in report["histogram_ms"]["buckets_ms"])
    lat = report["latency_ms"]
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]


def _cli(server, tmp_path, *extra: str) -> list[str]:
    return ["--target", server.target, "--concurrency", "2", "--requests", "10", "--warmup", "0",
            "--batch-size", "4", "--features", "user,item", "--no-progress", *extra]  # fmt: skip


def test_cli_writes_json(server, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert loadgen.main(_cli(server, tmp_path, "--json", str(out))) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["ok"] == 10 and report["errors"] == {}
    assert report["config"]["features"] == ["user", "item"] and report["config"]["token"] is None
    assert "QPS" in capsys.readouterr().out


def test_cli_writes_latency_png(server, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG needs the loadgen extra (matplotlib)")
    png = tmp_path / "latency.png"
    assert loadgen.main(_cli(server, tmp_path, "--png", str(png))) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_cli_rejects_unknown_features(server, capsys):
    argv = ["--target", server.target, "--features", "nope", "--requests", "1", "--no-progress"]
    assert loadgen.main(argv) == 2
    assert "nope" in capsys.readouterr().err


def test_requests_are_counted_after_the_warm_up(server, tmp_path, capsys):
    argv = _cli(server, tmp_path)
    argv[argv.index("--warmup") + 1] = "0.5"
    assert loadgen.main([*argv, "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] == 10 and report["concurrency"] == 2  # 10 measured, warm-up aside
    assert "concurrency 2: 10 ok" in capsys.readouterr().out


def test_a_run_that_measures_nothing_fails(server, tmp_path, capsys):
    argv = _cli(server, tmp_path)
    argv[argv.index("--warmup") + 1] = "1"
    assert loadgen.main([*argv, "--duration", "0"]) == 1
    assert "no request was measured" in capsys.readouterr().err


def test_png_without_matplotlib_fails_before_the_run(server, capsys, monkeypatch):
    def missing() -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(loadgen, "_pyplot", missing)
    argv = ["--target", "127.0.0.1:1", "--requests", "1", "--no-progress", "--png", "x.png"]
    assert loadgen.main(argv) == 2  # port 1: a run would have failed otherwise
    assert "--png needs matplotlib" in capsys.readouterr().err


def test_token_file(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with RunningServer(make_store(), auth_token_file=str(token)) as running:
        argv = ["--target", running.target, "--concurrency", "1", "--requests", "3"]
        argv += ["--warmup", "0", "--features", "user", "--batch-size", "2", "--no-progress"]
        assert loadgen.main([*argv, "--token-file", str(token)]) == 0
        assert "3 ok" in capsys.readouterr().out
        assert loadgen.main(argv) == 2  # without it: ListTables is refused, nothing is sent
        assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_latency_histogram_is_bounded_and_within_half_a_percent():
    rng = np.random.default_rng(0)
    seconds = rng.lognormal(math.log(2e-3), 1.0, 100_000)
    histogram = LatencyHistogram()
    size = histogram.counts.size
    for value in seconds:
        histogram.add(float(value))
    histogram.add(5e-7)  # below the range
    histogram.add(2e3)  # above it
    assert histogram.counts.size == size  # the memory does not grow with the run
    exact = np.concatenate([seconds, [5e-7, 2e3]])
    for q in (1, 50, 90, 99, 99.9):
        want = np.percentile(exact, q, method="inverted_cdf")
        assert abs(histogram.percentile(q) / want - 1) <= 0.005, q
    assert histogram.percentile(100) == 2e3 and histogram.percentile(0) == 5e-7
    assert histogram.count == exact.size and math.isclose(histogram.sum_s, exact.sum())


def test_concurrency_sweep_gives_one_step_per_value(server, tmp_path, capsys):
    argv = _cli(server, tmp_path)
    argv[argv.index("--concurrency") : argv.index("--concurrency") + 2] = [
        "--concurrency-range",
        "1:5:2",
    ]
    assert loadgen.main([*argv, "--json", str(tmp_path / "sweep.json")]) == 0
    steps = json.loads((tmp_path / "sweep.json").read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 3, 5]
    assert [s["ok"] for s in steps] == [10, 10, 10]
    out = capsys.readouterr().out
    table = [
        line for line in out.splitlines() if line.startswith("concurrency ") and ":" not in line
    ]
    assert len(table) == 3  # one row per step, after each step's own lines
    assert "load" in out and "p99.9_ms" in out


def test_request_rate_sweep(server, tmp_path, capsys):
    argv = ["--target", server.target, "--request-rate-range", "100:200:100", "--requests", "5",
            "--warmup", "0", "--batch-size", "2", "--no-progress"]  # fmt: skip
    assert loadgen.main([*argv, "--json", str(tmp_path / "rates.json")]) == 0
    steps = json.loads((tmp_path / "rates.json").read_text())["steps"]
    assert [(s["rate"], s["ok"]) for s in steps] == [(100.0, 5), (200.0, 5)]


@pytest.mark.parametrize("text", ["0:4", "4:2", "1:4:0", "a:b", "1:2:3:4"])
def test_bad_ranges_are_usage_errors(text, capsys):
    assert loadgen.main(["--concurrency-range", text, "--no-progress"]) == 2
    assert f"got '{text}'" in capsys.readouterr().err


def test_the_help_examples_sweep_up_to_their_end():
    # A range runs END only when a step lands on it: an example that stops short misleads.
    ranges = re.findall(r"-range (\S+)", loadgen.EXAMPLES)
    assert ranges
    for text in ranges:
        end = float(text.split(":")[1])
        assert loadgen.parse_range(text, float)[-1] == end, text


def test_recorded_requests_are_replayed_in_order(server, tmp_path, capsys):
    recorded = tmp_path / "recorded.jsonl"
    good = {"user": [[1, 2], [3]], "item": [[4]]}
    bad = {"user": [[10**6]]}  # out of range: the server refuses it
    recorded.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    argv = ["--target", server.target, "--input-data", str(recorded), "--concurrency", "1",
            "--requests", "4", "--warmup", "0", "--no-progress"]  # fmt: skip
    assert loadgen.main([*argv, "--json", str(tmp_path / "r.json")]) == 1  # errors: exit 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] == 2 and report["errors"] == {"INVALID_ARGUMENT": 2}
    recorded.write_text(json.dumps(good) + "\n" + json.dumps({"user": [[1.5]]}) + "\n")
    assert loadgen.main(argv) == 2
    assert f"{recorded}:2: feature 'user': ids must be integers, got 1.5" in capsys.readouterr().err
    recorded.write_text(json.dumps({"nope": [[1]]}) + "\n")
    assert loadgen.main(argv) == 2
    assert "features not served" in capsys.readouterr().err


def test_replayed_requests_count_their_own_samples(server, tmp_path, capsys):
    """samples/s counts each recorded request's batch (its largest feature's), not
    --batch-size: before, 6 replayed requests of 2 and 3 samples reported 6 x 64."""
    recorded = tmp_path / "recorded.jsonl"
    two = {"user": [[1, 2], [3]], "item": [[4]]}  # B = 2 and 1: two samples
    three = {"user": [[5], [], [6, 7]]}
    recorded.write_text(json.dumps(two) + "\n" + json.dumps(three) + "\n")
    argv = ["--target", server.target, "--input-data", str(recorded), "--concurrency", "1",
            "--requests", "6", "--warmup", "0", "--batch-size", "64", "--no-progress",
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert loadgen.main(argv) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] == 6 and report["samples"] == 3 * (2 + 3)
    assert report["samples_per_s"] == pytest.approx(15 / report["measured_s"])
    assert f"({report['samples_per_s']:.0f} samples/s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "argument --concurrency: must be > 0, got 0"),
        (["--rate", "0"], "argument --rate: must be > 0, got 0"),
        (["--rate", "nan"], "argument --rate: must be > 0, got nan"),
        (["--batch-size", "-1"], "argument --batch-size: must be > 0, got -1"),
        (["--requests", "x"], "argument --requests: invalid int value: 'x'"),
        (["--tls-ca", "{tmp}/missing.pem"], "--tls-ca: [Errno 2] No such file or directory"),
        (["--json", "{tmp}/no_dir/r.json"], "--json: [Errno 2] No such file or directory"),
        (["--json", "{tmp}"], "--json: [Errno 21] Is a directory"),
    ],
)
def test_bad_flags_are_one_line_usage_errors_before_the_run(
    server, tmp_path, capsys, flags, message
):
    """Each is exit 2 with one line naming the flag, before any request: before, --concurrency
    0 was a TypeError, a missing --tls-ca file a traceback, and an unwritable --json path a
    traceback after the whole run, its results lost."""
    argv = ["--target", server.target, "--requests", "10", "--warmup", "0", "--features", "user"]
    argv += ["--no-progress", *(f.format(tmp=tmp_path) for f in flags)]
    try:
        code = loadgen.main(argv)
    except SystemExit as exit_info:  # argparse's own usage errors
        code = exit_info.code
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.err.strip().splitlines()[-1]
    assert "QPS" not in captured.out and "Traceback" not in captured.err  # nothing was run
    assert list(tmp_path.iterdir()) == []  # the writability check leaves nothing behind


def test_version_and_plain_help(capsys):
    with pytest.raises(SystemExit) as version:
        loadgen.main(["--version"])
    assert version.value.code == 0
    assert capsys.readouterr().out.startswith("ibpembed-loadgen ")
    with pytest.raises(SystemExit):
        loadgen.main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "default: None" not in text and ":class:" not in text
    assert "--concurrency-range" in text and "--input-data" in text and "examples:" in text
    assert "9464/metrics" in text and "9100" not in text  # the server's metrics port


def test_help_writes_out_every_default(capsys):
    """docs/client.md promises every default in --help: each flag that has one prints it (a
    flag added without it fails here)."""
    with pytest.raises(SystemExit):
        loadgen.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines rewrapped as one
    for action in loadgen._parser()._actions:
        if action.default in (None, False, "", argparse.SUPPRESS):
            continue
        assert action.help is not None and "%(default)" in action.help, action.dest
    for shown in ("--zipf-alpha ZIPF_ALPHA Zipf exponent of the ids (1.05)",
                  "--deadline-ms DEADLINE_MS per-request deadline, ms (5000)",
                  "--pooling {sum,mean,none} how each sample's rows are combined (sum)",
                  "--seed SEED seed of the synthetic ids and arrivals (0)"):  # fmt: skip
        assert shown in text


def test_server_side_split_beside_the_clients_numbers(tmp_path: Path, capsys):
    """A real server process with metrics: its per-request time (queue, kernels, decode, encode,
    the rest) from two scrapes of /metrics around the measured window."""
    pack_table_set(tmp_path / "tables", make_table_set(), sample_rows=None)
    process = ServerProcess(
        "--tables",
        str(tmp_path / "tables"),
        "--workers",
        "1",
        "--metrics-port",
        str(free_port()),
        wait=False,
    )
    try:
        process.wait_bound()
        process.wait_listening()
        url = f"http://127.0.0.1:{process.metrics_port}/metrics"
        argv = ["--target", process.target, "--concurrency", "2", "--duration", "1.5",
                "--warmup", "0.3", "--batch-size", "64", "--features", "user,item",
                "--metrics-url", url, "--no-progress", "--json", str(tmp_path / "s.json"),
                ]  # fmt: skip
        assert loadgen.main(argv) == 0
    finally:
        process.kill()
    report = json.loads((tmp_path / "s.json").read_text())
    server = report["server"]
    # The scrapes bracket the window up to the requests answered while each scrape ran.
    assert abs(server["requests"] - report["ok"]) <= 0.02 * report["ok"] + 2
    mean = server["mean_ms"]
    assert mean["total"] > 0 and mean["kernels"] > 0 and mean["queue"] >= 0
    assert mean["decode"] > 0 and mean["encode"] > 0
    parts = ("queue", "kernels", "decode", "encode", "other")
    assert math.isclose(sum(mean[part] for part in parts), mean["total"])
    assert mean["other"] > 0  # the engine's planning, the hand-off: never nothing
    assert report["latency_ms"]["mean"] >= mean["total"]  # the client's time includes it
    out = capsys.readouterr().out
    assert "server (" in out and " + decode " in out and " + encode " in out
    with pytest.raises(ValueError, match="http"):
        asyncio.run(
            loadgen.run_load(
                loadgen.LoadConfig(target="x", concurrency=1, metrics_url="file:///etc/passwd")
            )
        )
