# SPDX-License-Identifier: Apache-2.0
"""The ``ibpembed`` entry point as a user meets it: help (``serve --help`` too) and version
without torch, every command listed with the summary its module registers, and ``triton-serve``
starting a real tritonserver on a table set with one command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ibpembed.cli import COMMANDS, build_parser
from ibpembed.triton.local import tritonserver_root
from tests.engine.helpers import FEATURES, make_store, source_tables
from tests.metrics.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "service"), str(ROOT / "clients" / "python"), str(ROOT)]
    ),
}


def _modules_after(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``ibpembed ARGS`` in a fresh interpreter; its output and the modules it imported."""
    code = (
        "import sys, json\n"
        "from ibpembed.cli import main\n"
        "try:\n"
        f"    main({list(args)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV
    )
    modules = set(json.loads(result.stderr.rsplit("MODULES ", 1)[1]))
    return result, modules


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("nope",), ("serve", "--help")])
def test_help_and_version_do_not_import_torch(args: tuple[str, ...]) -> None:
    result, modules = _modules_after(*args)
    assert "torch" not in modules and "numpy" not in modules, sorted(modules)[:20]
    if args == ("--help",):
        for name, (_, summary) in COMMANDS.items():
            assert name in result.stdout and summary.split()[0] in result.stdout
        assert "ibpembed-loadgen" in result.stdout  # not a subcommand: named in the epilog
    if args == ("--version",):
        assert result.stdout.startswith("ibpembed ")


def test_python_dash_m_runs_the_command() -> None:
    # For an environment where the `ibpembed` script is not on PATH.
    result = subprocess.run(
        [sys.executable, "-m", "ibpembed", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ibpembed ")


@pytest.mark.parametrize("command", ["pack", "inspect", "verify"])
def test_table_command_help_does_not_import_torch(command: str) -> None:
    # The table commands' parser is torch-free; their work (ibpembed.tables.commands) is not.
    result, modules = _modules_after(command, "--help")
    assert result.stdout.startswith(f"usage: ibpembed {command}"), result.stderr
    assert "torch" not in modules and "numpy" not in modules, sorted(modules)[:20]


def test_a_command_imports_only_its_own_module() -> None:
    _, modules = _modules_after("triton-repo", "--help")
    assert "ibpembed.triton.cli" in modules
    assert "ibpembed.server.cli" not in modules and "ibpembed.tables.cli" not in modules


def test_every_summary_is_the_one_its_module_registers() -> None:
    parser = build_parser()
    (subparsers,) = parser._subparsers._group_actions
    registered = {a.dest: a.help for a in subparsers._choices_actions}
    assert registered == {name: summary for name, (_, summary) in COMMANDS.items()}


def test_a_closed_pipe_ends_inspect_quietly(tmp_path: Path) -> None:
    make_store(seed=1).save(tmp_path / "tables")
    # `ibpembed inspect DIR | head -0`: the reader is gone before the first line is written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibpembed.cli", "inspect", str(tmp_path / "tables")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):  # not listening yet
        return 0, b""


@pytest.mark.skipif(tritonserver_root() is None, reason="nvidia-pytriton not installed")
def test_triton_serve_answers_like_the_engine_and_stops_on_sigterm(tmp_path: Path) -> None:
    store = make_store(seed=3)
    store.save(tmp_path / "tables")
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibpembed.cli", "triton-serve", str(tmp_path / "tables"),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )  # fmt: skip
    try:
        give_up = time.monotonic() + 180
        while _get(f"http://127.0.0.1:{http}/v2/health/ready")[0] != 200:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < give_up, "tritonserver not ready in 180 s"
            time.sleep(0.5)
        feature = "user"  # an fp32 table (tests/engine/helpers.py)
        request = {
            "inputs": [
                {"name": f"{feature}__ids", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]},
                {"name": f"{feature}__lengths", "datatype": "INT32", "shape": [2], "data": [2, 1]},
            ]
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/ibpembed/infer",
            data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as response:
            (output,) = json.loads(response.read())["outputs"]
        got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
        rows = source_tables(3)[FEATURES[feature]].numpy()  # the raw rows it was packed from
        expected = np.stack([rows[1] + rows[2], rows[3]])
        np.testing.assert_array_equal(got, expected)
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=90)[0]
    assert proc.returncode == 0, log[-3000:]


def test_serve_prints_its_load_progress_between_bound_and_listening(tmp_path: Path) -> None:
    make_store(seed=1).save(tmp_path / "tables")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibpembed.cli", "serve", "--tables", str(tmp_path / "tables"),
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("listening on"):
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    text = "".join(lines)
    assert text.startswith("bound "), text
    progress = [line for line in lines if line.startswith("loading: ")]
    assert progress, text
    total = len(set(FEATURES.values()))
    assert progress[-1].startswith(f"loading: {total}/{total} tables"), text
    assert text.index("loading: ") < text.index("listening on")
