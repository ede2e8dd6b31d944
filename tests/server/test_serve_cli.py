# SPDX-License-Identifier: Apache-2.0
"""``ibpembed serve`` as a process: banner, example query, health, reflection, SIGTERM drain."""

from __future__ import annotations

import base64
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import ibpembed
from ibpembed.server import app
from ibpembed.tables.store import TableStore
from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, build_request
from tests.engine.helpers import make_store
from tests.metrics.helpers import free_port
from tests.server.helpers import DEMO_300, RunningServer
from tools.serve_process import IBPEMBED, REPO, ServerProcess


@pytest.fixture
def serve():
    process = ServerProcess(*DEMO_300, "--grace-s", "60")
    yield process
    process.kill()


def test_banner_example_query_health_and_reflection(serve):
    serve.wait_for("grpcurl -plaintext")
    line = next(x for x in serve.stdout_lines if x.strip().startswith("python -c"))
    argv = shlex.split(line.strip())
    argv[0] = sys.executable
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    values = out.replace("[", " ").replace("]", " ").split()
    assert out.startswith("[[") and len(values) == 128  # one pooled D=128 row, printed by numpy
    assert all(float(v) == float(v) for v in values)

    client = LookupClient(serve.target, timeout=30)
    assert client.is_serving() and client.is_serving("ibpembed.v1.EmbeddingLookup")
    assert len(client.list_tables()) == 26
    with grpc.insecure_channel(serve.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "ibpembed.v1.EmbeddingLookup" in services and "grpc.health.v1.Health" in services
    client.close()


GRPCURL = shutil.which("grpcurl")


def _run_grpcurl(line: str) -> np.ndarray:
    """A banner's grpcurl line, run where the server runs (its typed proto path is relative
    to that); the pooled row it prints."""
    argv = shlex.split(line.strip())
    assert argv[0] == "grpcurl"
    argv[0] = GRPCURL
    answer = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert answer.returncode == 0, answer.stderr
    (feature,) = json.loads(answer.stdout)["features"]
    if isinstance(feature["values"], list):  # the typed proto: floats
        return np.array(feature["values"], dtype=np.float32)
    return np.frombuffer(base64.b64decode(feature["values"]), dtype=np.float32)  # bytes


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed: scripts/ci_install_grpcurl.sh")
def test_the_banner_grpcurl_query_runs_typed_and_through_reflection(serve, monkeypatch):
    serve.wait_for("grpcurl -plaintext")
    line = next(x for x in serve.stdout_lines if x.strip().startswith("grpcurl"))
    assert "-proto ibpembed/v1/lookup_typed.proto" in line and '"ids": ["1", "2"]' in line
    typed = _run_grpcurl(line)
    with LookupClient(serve.target, timeout=30) as client:
        want = client.lookup({"cat_0": [[1, 2]]})["cat_0"].ravel()
    assert typed.tobytes() == want.tobytes()
    # Without the proto files (an installed wheel): lookup.proto through reflection, base64.
    monkeypatch.setattr(app, "TYPED_PROTO_ROOT", REPO / "no_such_dir")
    port = int(serve.target.rsplit(":", 1)[1])
    query = app.example_query("127.0.0.1", port, "cat_0", tls=False, token=False)
    fallback = next(x for x in query.splitlines() if x.strip().startswith("grpcurl"))
    assert "-proto" not in fallback
    assert _run_grpcurl(fallback).tobytes() == want.tobytes()


def test_reflection_is_v1alpha_and_v1_is_unimplemented():
    """docs/server.md: grpcio-reflection has no v1 service. UNIMPLEMENTED there is what makes
    grpcurl >= 1.8.8, which asks for v1 first, fall back to v1alpha."""
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    answers = {}
    with RunningServer(make_store()) as running, grpc.insecure_channel(running.target) as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            try:
                (answer,) = call(iter([ask]), timeout=30)
                answers[version] = [s.name for s in answer.list_services_response.service]
            except grpc.RpcError as err:
                answers[version] = err.code()
    assert answers["v1"] == grpc.StatusCode.UNIMPLEMENTED
    assert "ibpembed.v1.EmbeddingLookup" in answers["v1alpha"]


def test_sigterm_drains_in_flight_stream_then_exits_zero(serve):
    client = LookupClient(serve.target, timeout=60)
    outbox: queue.Queue = queue.Queue()
    responses = client.lookup_stream(iter(outbox.get, None))
    outbox.put(build_request({"cat_0": [[1, 2]]}, request_id="before"))
    assert next(responses).request_id == "before"  # the stream is open and in flight

    serve.proc.send_signal(signal.SIGTERM)
    serve.wait_for("draining")
    fresh = LookupClient(serve.target, timeout=30, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(LookupServiceError) as info:
        fresh.lookup({"cat_0": [[1]]})
    assert info.value.code == grpc.StatusCode.UNAVAILABLE

    outbox.put(build_request({"cat_0": [[3]]}, request_id="during-drain"))
    after = next(responses)
    assert after.request_id == "during-drain" and after["cat_0"].shape == (1, 128)
    outbox.put(None)  # the client finishes its stream; the server may now exit
    assert list(responses) == []
    assert serve.proc.wait(timeout=60) == 0
    fresh.close()
    client.close()


def test_help_lists_every_setting():
    out = subprocess.run(
        [*IBPEMBED, "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for flag in ("--host", "--port", "--metrics-port", "--tables", "--device", "--config"):
        assert flag in out
    # Plain text, each flag with its environment variable and default.
    flat = " ".join(out.split())
    assert "``" not in out and ":mod:" not in out and "`" not in out
    assert "(env IBPEMBED_PORT; default 50051)" in flat
    assert "(env IBPEMBED_KEEP_VERSIONS; default 2)" in flat
    assert "(env IBPEMBED_WORKERS; default min(4, CPUs))" in flat
    assert "(env IBPEMBED_TABLES; default unset)" in flat
    assert "(env IBPEMBED_REFLECTION; default true)" in flat
    top = subprocess.run(
        [*IBPEMBED, "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "COMMAND_MODULES" not in top and "``" not in top


def test_version():
    result = subprocess.run(
        [*IBPEMBED, "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == f"ibpembed {ibpembed.__version__}"


def test_json_logs_are_one_object_a_line():
    server = ServerProcess(*DEMO_300, "--log-format", "json")
    try:
        assert server.stop() == 0
    finally:
        server.kill()
    records = [json.loads(line) for line in server.stderr_lines if line.strip()]
    assert records, server.log()
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys()
    messages = [r["message"] for r in records]
    assert any("loading the embedded demo" in m for m in messages)
    assert any("draining" in m for m in messages)


def test_bad_config_fails_fast(tmp_path: Path):
    config = tmp_path / "server.toml"
    config.write_text("no_such_setting = 1\n")
    result = subprocess.run(
        [*IBPEMBED, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "no_such_setting" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "env"),
    [(("--log-level", "verbose"), {}), ((), {"IBPEMBED_LOG_LEVEL": "verbose"})],
)
def test_an_unknown_log_level_is_a_configuration_error(argv, env):
    result = subprocess.run(
        [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 2 and "verbose" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (("--inline-max-ids", "-1"), "inline_max_ids must be >= 0, got -1"),
        (("--dedupe-max-unique-fraction", "2"), "dedupe_max_unique_fraction must be in [0, 1]"),
    ],
)
def test_a_setting_only_the_engine_used_to_check_fails_before_loading(flag, message):
    result = subprocess.run(
        [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", *DEMO_300, *flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"ibpembed serve: bad configuration: {message}" in result.stderr
    assert "loading" not in result.stdout and "Traceback" not in result.stderr


def test_a_server_that_fails_to_build_after_loading_stops_cleanly():
    """A failure between the load and serving (here a config no validate() saw, which the
    engine refuses) stops the gRPC and metrics servers on the running loop: before, the gRPC
    server was left to the garbage collector, which raised "Event loop is closed"."""
    grpc_port, metrics_port = free_port(), free_port()
    script = f"""
import asyncio, socket
from ibpembed.server.app import serve
from ibpembed.server.config import ServerConfig
config = ServerConfig(
    port={grpc_port}, metrics_port={metrics_port}, demo_max_rows=300, workers=1,
    inline_max_ids=-1,
)
try:
    asyncio.run(serve(config))
except ValueError as exc:
    print("refused:", exc)
for port in ({grpc_port}, {metrics_port}):
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # both servers let go of their ports
print("ports free")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "refused: inline_max_ids must be >= 0" in result.stdout
    assert "ports free" in result.stdout
    assert "Event loop is closed" not in result.stderr and "never awaited" not in result.stderr


def test_a_busy_port_is_a_start_up_error():
    port = free_port()
    first = ServerProcess(*DEMO_300, "--port", str(port), "--metrics-port", "0")
    try:
        result = subprocess.run(
            [*IBPEMBED, "serve", "--port", str(port), "--metrics-port", "0", "--demo-max-rows",
             "300"],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert f"ibpembed serve: cannot listen on 127.0.0.1:{port}: the port is in use" in (
            result.stderr
        )
        assert "Traceback" not in result.stderr
        # Probed before grpc binds: its C core's own error line does not precede ours.
        assert "Failed to add port" not in result.stderr, result.stderr
        client = LookupClient(first.target, timeout=30)
        assert client.is_serving()  # the first one is untouched
        client.close()
    finally:
        first.kill()


def test_missing_table_set_fails_with_a_message(tmp_path: Path):
    missing = tmp_path / "no_tables_here"
    result = subprocess.run(
        [*IBPEMBED, "serve", "--port", "0", "--tables", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"ibpembed serve: {missing}: no such directory\n"
    assert "bound" not in result.stdout  # refused before binding any port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_tables_load_exits_zero_without_serving(sig):
    # The full-size demo set takes seconds to build: the signal lands in the middle of it.
    proc = subprocess.Popen(
        [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "loading the embedded demo" in line:
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"{sig.name} while loading the tables" in err and "Traceback" not in err
    assert "listening on" not in out


def test_an_empty_table_set_is_served_without_a_query_to_copy(tmp_path: Path):
    """A shard that holds no rows yet: the banner claims no savings and no feature."""
    TableStore.from_tables({}).save(tmp_path / "empty")
    with ServerProcess("--tables", str(tmp_path / "empty"), "--metrics-port", "0") as server:
        banner = server.log()
        assert "0 tables, 0 raw bytes stored in 0 (no rows)" in banner, banner
        assert "no feature to query yet" in banner and "example query" not in banner
        with LookupClient(server.target, timeout=30) as client:
            assert client.list_tables() == []
