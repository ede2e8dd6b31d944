# SPDX-License-Identifier: Apache-2.0
"""The Triton Python-backend model on a REAL tritonserver (the binary in the nvidia-pytriton
wheel), driven by tritonclient over HTTP (in this process) and gRPC (in its own venv: its gRPC
client needs protobuf<7), with and without Triton's system shared memory.

Every pooled and row result is compared bit for bit with ``ibpembed serve`` (a real gRPC server)
on the same table files. Bad inputs must come back as Triton error responses naming the input,
and the model must keep answering afterwards (a crashed stub would fail every later request).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# NOTE: this folder has no __init__.py, and is not named "triton": pytest puts tests/ on
# sys.path, where a tests/triton directory would be imported as OpenAI's triton by torch.compile.
from triton_requests import run_requests  # this folder is on sys.path (no __init__.py)

from ibpembed.codec import compress
from ibpembed.tables.store import TableStore
from ibpembed.triton.repo import RepositoryError, write_repository
from ibpembed_client import FeatureBatch, LookupClient, bf16_to_float32
from tests.engine.helpers import make_store
from tests.server.helpers import RunningServer
from tools.triton_process import REPO, TritonProcess, tritonserver_root

if tritonserver_root() is None or importlib.util.find_spec("tritonclient.http") is None:
    pytest.skip(
        "tritonserver / tritonclient are not installed: "
        "pip install --no-deps -r requirements/triton.txt (make setup does)",
        allow_module_level=True,
    )

import tritonclient.http as http
from tritonclient.utils import InferenceServerException

HERE = Path(__file__).resolve().parent
GRPC_PYTHON = Path(
    os.environ.get("IBPEMBED_TRITON_GRPC_PYTHON", REPO / ".venv-triton-grpc" / "bin" / "python")
)
# The table set of make_store: (feature, table rows, pooled dim, stored dtype).
FEATURES = {
    "ctx": (300, 3, "float16"),
    "item": (500, 8, "bfloat16"),
    "quant": (300, 12, "int8_rowwise"),
    "user": (1000, 16, "float32"),
    "user_hist": (1000, 16, "float32"),
}


@dataclass
class Setup:
    triton: TritonProcess
    serve: str  # `ibpembed serve` (v2 tables) on loopback
    serve_v1: str  # the same for the v1 tables
    features: list[str]  # the ensemble's dense model's order


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("triton")
    make_store(seed=1).save(root / "tables_v1")
    make_store(seed=2).save(root / "tables_v2")
    repo = root / "repo"
    write_repository(root / "tables_v1", repo)  # version 1
    write_repository(root / "tables_v2", repo)  # version 2: Triton serves the latest
    write_repository(root / "tables_v2", repo, name="ibpembed_rows", pooling="none")
    spec = importlib.util.spec_from_file_location(
        "triton_ensemble", REPO / "examples" / "triton_ensemble.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ensemble_repo = root / "ensemble"
    features = example.write_ensemble(root / "tables_v2", ensemble_repo)
    for model in ("dense", "dlrm"):  # one server for all: ibpembed of both repos is the same
        (ensemble_repo / model).rename(repo / model)
    triton = TritonProcess(repo, wait=False)
    serve = RunningServer(TableStore.load(root / "tables_v2"))
    serve_v1 = RunningServer(TableStore.load(root / "tables_v1"))
    try:
        triton.wait_ready()
        yield Setup(triton, serve.target, serve_v1.target, features)
    finally:
        serve.stop()
        serve_v1.stop()
        triton.stop()


@pytest.fixture(scope="module")
def client(setup: Setup) -> Iterator[http.InferenceServerClient]:
    c = http.InferenceServerClient(setup.triton.http)
    yield c
    c.close()


def random_batch(seed: int, batch: int, weighted: bool = False) -> dict[str, FeatureBatch]:
    """Every feature, with empty bags, repeated ids and each table's last row."""
    rng = np.random.default_rng(seed)
    out = {}
    for feature, (rows, _, _) in FEATURES.items():
        lengths = rng.integers(0, 6, batch).astype(np.int32)
        if batch:
            lengths[0] = 0
        ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
        if ids.size:
            ids[-1] = rows - 1
        weights = rng.uniform(-2, 2, ids.size).astype(np.float32) if weighted else None
        out[feature] = FeatureBatch(ids, lengths, weights)
    return out


def triton_inputs(batch: dict[str, FeatureBatch]) -> dict[str, np.ndarray]:
    inputs = {}
    for feature, fb in batch.items():
        inputs[f"{feature}__ids"] = fb.ids
        inputs[f"{feature}__lengths"] = fb.lengths
        if fb.weights is not None:
            inputs[f"{feature}__weights"] = fb.weights
    return inputs


def infer_http(
    client: http.InferenceServerClient,
    inputs: dict[str, np.ndarray],
    model: str = "ibpembed",
    **kwargs: Any,
) -> http.InferResult:
    items = []
    for name, array in inputs.items():
        dtype = {np.dtype("int64"): "INT64", np.dtype("int32"): "INT32"}.get(array.dtype, "FP32")
        item = http.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        items.append(item)
    return client.infer(model, items, **kwargs)


def serve_lookup(target: str, batch: dict[str, FeatureBatch], pooling: str) -> dict:
    with LookupClient(target) as c:
        result = c.lookup(batch, pooling=pooling)
    return dict(result)


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.tobytes() == expected.tobytes()


def run_grpc(setup: Setup, requests: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """``requests`` (see triton_requests.py) sent by tritonclient's gRPC client, in its venv."""
    if not GRPC_PYTHON.exists():
        pytest.fail(
            f"{GRPC_PYTHON} is missing: make setup builds it (python -m venv .venv-triton-grpc "
            "&& .venv-triton-grpc/bin/pip install --no-deps -r requirements/triton-grpc.txt)"
        )
    spec = tmp / "spec.json"
    spec.write_text(
        json.dumps({"protocol": "grpc", "url": setup.triton.grpc, "requests": requests})
    )
    result = tmp / "result.json"
    subprocess.run(
        [str(GRPC_PYTHON), str(HERE / "triton_requests.py"), str(spec), str(result)],
        check=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    return json.loads(result.read_text())


def saved_inputs(inputs: dict[str, np.ndarray], tmp: Path, tag: str) -> dict[str, str]:
    paths = {}
    for name, array in inputs.items():
        path = tmp / f"{tag}_{name}.npy"
        np.save(path, array)
        paths[name] = str(path)
    return paths


# -- results: bit-exact against `ibpembed serve` -------------------------------------------------


@pytest.mark.parametrize(("batch", "weighted"), [(1, False), (7, True), (64, False), (0, False)])
def test_pooled_http_equals_ibpembed_serve(setup, client, batch: int, weighted: bool) -> None:
    fb = random_batch(batch, batch, weighted)
    result = infer_http(client, triton_inputs(fb))
    expected = serve_lookup(setup.serve, fb, "sum")
    for feature in FEATURES:
        assert_same_bits(result.as_numpy(f"{feature}__pooled"), expected[feature])


def test_mean_through_a_request_parameter(setup, client) -> None:
    fb = random_batch(5, 9, weighted=True)
    result = infer_http(client, triton_inputs(fb), parameters={"pooling": "mean"})
    expected = serve_lookup(setup.serve, fb, "mean")
    for feature in FEATURES:
        assert_same_bits(result.as_numpy(f"{feature}__pooled"), expected[feature])


def test_rows_model_returns_the_table_dtype_bit_exact(setup, client) -> None:
    fb = random_batch(3, 6)
    result = infer_http(client, triton_inputs(fb), model="ibpembed_rows")
    expected = serve_lookup(setup.serve, fb, "none")
    for feature, (_, _, dtype) in FEATURES.items():
        got = result.as_numpy(f"{feature}__rows")
        if dtype == "bfloat16":  # tritonclient widens BF16 to float32; the client gives bits
            assert_same_bits(got.astype(np.float32), bf16_to_float32(expected[feature]))
        else:
            assert_same_bits(got, expected[feature])


def test_a_subset_of_the_features(setup, client) -> None:
    fb = {k: v for k, v in random_batch(4, 3).items() if k in ("item", "user")}
    result = infer_http(client, triton_inputs(fb))
    names = sorted(o["name"] for o in result.get_response()["outputs"])
    assert names == ["item__pooled", "user__pooled"]
    expected = serve_lookup(setup.serve, fb, "sum")
    assert_same_bits(result.as_numpy("user__pooled"), expected["user"])


def test_version_directories_are_table_set_versions(setup, client) -> None:
    fb = random_batch(8, 4)
    # The latest version (2) serves tables_v2; version 1 is not loaded (latest: 1).
    result = infer_http(client, triton_inputs(fb))
    assert result.get_response()["model_version"] == "2"
    assert_same_bits(result.as_numpy("user__pooled"), serve_lookup(setup.serve, fb, "sum")["user"])
    assert not np.array_equal(
        result.as_numpy("user__pooled"), serve_lookup(setup.serve_v1, fb, "sum")["user"]
    )
    with pytest.raises(
        InferenceServerException, match=r"ibpembed.*version 1|version 1.*ibpembed|unavailable"
    ):
        infer_http(client, triton_inputs(fb), model_version="1")


def test_http_system_shared_memory(setup, tmp_path) -> None:
    fb = random_batch(11, 5, weighted=True)
    outputs = {f"{f}__pooled": ["float32", [5, dim]] for f, (_, dim, _) in FEATURES.items()}
    request = {
        "inputs": saved_inputs(triton_inputs(fb), tmp_path, "shm"),
        "outputs": outputs,
        "shm": True,
    }
    (result,) = run_requests("http", setup.triton.http, [request], tmp_path)
    assert "outputs" in result, result
    expected = serve_lookup(setup.serve, fb, "sum")
    for feature in FEATURES:
        assert_same_bits(np.load(result["outputs"][f"{feature}__pooled"]), expected[feature])


def test_grpc_with_and_without_shared_memory(setup, tmp_path) -> None:
    batches = [random_batch(20 + k, b, weighted=k == 1) for k, b in enumerate([1, 16, 3])]
    requests = []
    for k, fb in enumerate(batches):
        batch = len(fb["user"].lengths)
        outputs = {f"{f}__pooled": ["float32", [batch, d]] for f, (_, d, _) in FEATURES.items()}
        requests.append(
            {
                "inputs": saved_inputs(triton_inputs(fb), tmp_path, f"g{k}"),
                "outputs": outputs,
                "shm": k != 0,
            }
        )
    results = run_grpc(setup, requests, tmp_path)
    for fb, result in zip(batches, results, strict=True):
        assert "outputs" in result, result
        expected = serve_lookup(setup.serve, fb, "sum")
        for feature in FEATURES:
            assert_same_bits(np.load(result["outputs"][f"{feature}__pooled"]), expected[feature])


def test_ensemble_scores_a_batch_in_one_request(setup, client) -> None:
    fb = random_batch(30, 12)
    inputs = {
        name: array for name, array in triton_inputs(fb).items() if not name.endswith("__weights")
    }
    result = infer_http(client, inputs, model="dlrm")
    score = result.as_numpy("score")
    assert score.shape == (12, 1)
    # The same MLP on the pooled features `ibpembed serve` returns.
    spec = importlib.util.spec_from_file_location(
        "triton_ensemble", REPO / "examples" / "triton_ensemble.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pooled = serve_lookup(setup.serve, fb, "sum")
    features = torch.cat([torch.from_numpy(pooled[f].copy()) for f in setup.features], dim=1)
    mlp = torch.jit.script(example.dense_mlp(features.shape[1]))
    with torch.no_grad():
        expected = torch.sigmoid(mlp(features)).numpy()
    assert_same_bits(score, expected)


def test_metrics_on_tritons_endpoint(setup, client) -> None:
    infer_http(client, triton_inputs(random_batch(40, 2)))
    text = setup.triton.metrics()
    lines = [line for line in text.splitlines() if line.startswith("ibpembed_")]
    assert any(
        line.startswith("ibpembed_requests_total{") and 'code="OK"' in line for line in lines
    )
    assert any(
        line.startswith("ibpembed_rows_looked_up_total{") and 'table="emb_f32"' in line
        for line in lines
    )
    stored = [line for line in lines if line.startswith("ibpembed_table_stored_bytes{")]
    assert {line.split('table="')[1].split('"')[0] for line in stored} >= {"emb_f32", "emb_q8"}
    counts = [
        line
        for line in lines
        if line.startswith("ibpembed_lookup_duration_seconds_count{") and 'pooling="sum"' in line
    ]
    assert counts and float(counts[0].rsplit(" ", 1)[1]) >= 1
    # The server's buckets, so dashboards read both alike.
    assert any('le="2.5e-05"' in line for line in lines)


def test_latency_buckets_are_the_servers() -> None:
    from ibpembed.server.metrics import LATENCY_BUCKETS_S as SERVER_BUCKETS
    from ibpembed.triton.model import LATENCY_BUCKETS_S

    assert LATENCY_BUCKETS_S == SERVER_BUCKETS


# -- bad input: Triton error responses naming the input ------------------------------------------

GOOD = {"user": FeatureBatch(np.array([1, 2, 3]), np.array([2, 1], dtype=np.int32))}


def bad_cases() -> list[tuple[str, dict[str, np.ndarray], dict[str, Any], str]]:
    ids, lengths = GOOD["user"].ids, GOOD["user"].lengths
    return [
        ("missing ids", {"user__lengths": lengths}, {}, r"input 'user__ids' is missing"),
        ("missing lengths", {"user__ids": ids}, {}, r"input 'user__lengths' is missing"),
        (
            "mismatched lengths",
            {"user__ids": ids, "user__lengths": np.array([2, 2], dtype=np.int32)},
            {},
            r"user__lengths: sum to 4 but feature 'user' has 3 ids",
        ),
        (
            "negative lengths",
            {"user__ids": ids, "user__lengths": np.array([4, -1], dtype=np.int32)},
            {},
            r"user__lengths: counts must be non-negative",
        ),
        (
            "unknown feature",
            {"nope__ids": ids, "nope__lengths": lengths},
            {},
            r"unexpected inference input 'nope__(ids|lengths)'",
        ),
        (
            "out-of-range id",
            {"user__ids": np.array([1, 2, 1000]), "user__lengths": lengths},
            {},
            r"user__ids: feature 'user': id 1000 out of range for table 'emb_f32'",
        ),
        (
            "negative id",
            {"ctx__ids": np.array([-1]), "ctx__lengths": np.array([1], dtype=np.int32)},
            {},
            r"ctx__ids: feature 'ctx': id -1 out of range",
        ),
        (
            "weights of the wrong size",
            {"user__ids": ids, "user__lengths": lengths, "user__weights": np.ones(2, np.float32)},
            {},
            r"user__weights",
        ),
        (
            "ids of the wrong dtype",
            {"user__ids": ids.astype(np.int32), "user__lengths": lengths},
            {},
            r"user__ids",
        ),
        (
            "pooling the outputs cannot carry",
            {"user__ids": ids, "user__lengths": lengths},
            {"parameters": {"pooling": "none"}},
            r"parameter 'pooling'",
        ),
        ("no input at all", {}, {}, r"input"),
    ]


@pytest.mark.parametrize(("case", "inputs", "kwargs", "message"), bad_cases(), ids=lambda x: x)
def test_bad_input_http(setup, client, case, inputs, kwargs, message) -> None:
    with pytest.raises(InferenceServerException, match=message):
        infer_http(client, inputs, **kwargs)
    # The stub is still there: the next request is answered.
    good = infer_http(client, triton_inputs(GOOD))
    assert good.as_numpy("user__pooled").shape == (2, 16)


def test_weights_on_the_rows_model(client) -> None:
    fb = GOOD["user"]
    inputs = {"user__ids": fb.ids, "user__lengths": fb.lengths, "user__weights": np.ones(3, "f4")}
    with pytest.raises(
        InferenceServerException, match="input 'user__weights': weights need pooling"
    ):
        infer_http(client, inputs, model="ibpembed_rows")


def test_bad_input_grpc(setup, tmp_path) -> None:
    cases = [c for c in bad_cases() if c[1]]  # gRPC's client refuses an empty request itself
    requests = [
        {
            "inputs": saved_inputs(inputs, tmp_path, f"bad{k}"),
            "parameters": kwargs.get("parameters"),
        }
        for k, (_, inputs, kwargs, _) in enumerate(cases)
    ]
    requests.append({"inputs": saved_inputs(triton_inputs(GOOD), tmp_path, "good")})
    results = run_grpc(setup, requests, tmp_path)
    for (case, _, _, message), result in zip(cases, results, strict=False):
        assert "error" in result, (case, result)
        assert re.search(message, result["error"]), (case, result["error"])
    assert "outputs" in results[-1], results[-1]


def test_a_bad_feature_fails_the_whole_request(setup, client) -> None:
    # A request mixing a good and a bad feature fails as a whole: no tensor for the good one.
    inputs = {**triton_inputs(GOOD), "ctx__ids": np.array([999]), "ctx__lengths": np.ones(1, "i4")}
    with pytest.raises(InferenceServerException, match="ctx__ids"):
        infer_http(client, inputs)


# -- the repository writer -----------------------------------------------------------------------


def test_a_version_with_other_features_is_refused(tmp_path) -> None:
    make_store().save(tmp_path / "a")
    write_repository(tmp_path / "a", tmp_path / "repo")
    TableStore.from_tables({"t": compress(torch.randn(5, 4))}, {"other": "t"}).save(tmp_path / "b")
    with pytest.raises(RepositoryError, match="written for other features"):
        write_repository(tmp_path / "b", tmp_path / "repo")
    with pytest.raises(RepositoryError, match="exists already"):
        write_repository(tmp_path / "a", tmp_path / "repo", version=1)


@pytest.mark.parametrize("name", ["../evil", "/tmp/evil", "a/b", "..", ".", ""])
def test_a_model_name_that_is_not_one_directory_is_refused(tmp_path, name: str) -> None:
    """The model directory is REPO/NAME: a name with a separator or '..' would write outside
    the repository (``--name ../evil`` wrote REPO/../evil), so nothing is written."""
    make_store().save(tmp_path / "tables")
    repo = tmp_path / "place" / "repo"
    with pytest.raises(RepositoryError, match="model name must be one directory name"):
        write_repository(tmp_path / "tables", repo, name=name)
    bad = subprocess.run(
        [sys.executable, "-m", "ibpembed.cli", "triton-repo", str(tmp_path / "tables"),
         "-o", str(repo), "--name", name],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "argument --name: model name must be one directory name" in bad.stderr
    assert not (tmp_path / "place").exists()


def test_cli_writes_the_repository(tmp_path) -> None:
    make_store().save(tmp_path / "tables")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "ibpembed.cli", "triton-repo", str(tmp_path / "tables")),
            *("-o", str(tmp_path / "repo"), "--pooling", "mean", "--feature", "user"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "version 1" in run.stdout
    config = (tmp_path / "repo" / "ibpembed" / "config.pbtxt").read_text()
    assert 'name: "user__ids" data_type: TYPE_INT64' in config
    assert 'name: "user__pooled" data_type: TYPE_FP32 dims: [ -1, 16 ]' in config
    assert "item__ids" not in config
    assert 'string_value: "mean"' in config
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "ibpembed.cli",
            "triton-repo",
            str(tmp_path),
            "-o",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("ibpembed triton-repo: error: ") and "no manifest" in bad.stderr
    nope = tmp_path / "nope"
    missing = subprocess.run(
        [sys.executable, "-m", "ibpembed", "triton-repo", str(nope), "-o", str(tmp_path / "r")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert missing.stderr == f"ibpembed triton-repo: error: {nope}: no such directory\n"
