# SPDX-License-Identifier: Apache-2.0
"""One short trial of each process-level check (reliability.faults, reliability.soak).

Timing-free: these assert outcomes (status codes, exit codes, descriptors), never durations;
the scripts' own time-based criteria (drain time, p99 ratio) are for the full runs.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from reliability import faults, soak
from tools.serve_process import ServerProcess


def test_kill_during_live_reload_keeps_every_lookup_on_one_version(tmp_path: Path) -> None:
    result = faults.kill_reload(tmp_path, 1, 300, random.Random(0))
    assert result["failures"] == []
    totals = result["child_totals"]
    # Lookups and reloads both ran (a reader that died at once would leave bad at 0 too), and
    # none of the lookups saw two versions or raised.
    assert totals["reads"] > 0 and totals["reloads"] > 0, result
    assert totals["bad"] == 0 and totals["read_errors"] == 0, result


def test_live_reloads_under_load_serve_whole_versions_and_never_a_corrupt_one(
    tmp_path: Path,
) -> None:
    result = faults.reload_under_load(tmp_path, 3, 300, random.Random(0))  # the third is corrupt
    assert result["failures"] == []
    assert result["corrupt_sets_published"] == 1 and result["failed_reloads_logged"] >= 1
    assert result["versions_published"] == 3 and set(result["calls"]) == {"OK"}


def test_sigterm_under_load_completes_admitted_calls_and_exits_zero(tmp_path: Path) -> None:
    result = faults.sigterm_under_load(tmp_path, 1, 0, random.Random(0))
    assert result["failures"] == []
    (run,) = result["runs"]
    assert run["exit_code"] == 0 and run["calls_started_before_sigterm"].get("OK", 0) > 0


def test_vanishing_stream_clients_leave_no_descriptor_and_no_stuck_call(tmp_path: Path) -> None:
    result = faults.vanishing_client(tmp_path, 1, 0, random.Random(0))
    assert result["clients_killed"] == 2
    assert result["fds"][1] <= result["fds"][0]
    assert result["sigterm_exit_code"] == 0


def test_short_soak_has_no_error_but_overload() -> None:
    args = argparse.Namespace(duration=2.0, window=1.0, concurrency=8, batch_size=8)
    with ServerProcess(
        "--max-inflight", "4", "--demo-max-rows", "300", "--device", "cpu"
    ) as server:
        verdict = soak.soak(server, args)["verdict"]
    assert verdict["unexpected_errors"] == {}
    assert verdict["server_alive"] and verdict["requests_ok"] > 0
    assert verdict["fds_idle_after"] <= verdict["fds_idle_before"]
