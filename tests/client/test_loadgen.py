# SPDX-License-Identifier: Apache-2.0
"""The load generator against a real server, and its traffic model."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from ibpembed_client import loadgen
from ibpembed_client.workload import DCNV2_POOLING_FACTORS, ZipfIds, hotness_for, make_requests
from tests.server.helpers import RunningServer, make_store


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
    assert report["ok"] == len(report["latencies_ms"]) <= 40
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
