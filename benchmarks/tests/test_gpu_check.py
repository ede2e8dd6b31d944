# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check.py --dry-run: the GPU script's driver and the CPU half of its phases, so
they do not rot between the rare runs on a GPU machine (table tiling and the raw layout are
checked against the CPU decoder; a fault, a failed registration and the deadline take the
branches they take on the GPU).

With no GPU the correctness checks compare the CPU ops with independent answers (the source rows
for gathers and decompression, ``ibpembed.reference`` for pooled lookups), so a wrong CPU op fails
here: the counts below are those real checks, every one of them run and passed."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import ibpembed
from benchmarks import gpu_check


def test_dry_run_runs_every_phase_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--profile", "dlrm-bf16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert set(phases) == {
        "build",
        "preflight",
        "correctness",
        "served",
        "sanitizer",
        "h2d",
        *(f"timing_{r}" for r in gpu_check.TIMING_ORDER),
        "timing_512_thp",
    }
    assert "correctness_sync" not in phases  # only after a failure
    assert phases["sanitizer"] == {"skipped": "no GPU"}
    assert report["failed_phases"] == []
    correctness = phases["correctness"]
    assert correctness["failures"] == [] and correctness["fault"] is None
    assert correctness["against"] == "source rows and ibpembed.reference"
    cases = [table for _, table, _ in gpu_check.small_cases()]
    floating = sum(table.dtype.is_floating_point for table in cases)
    assert correctness["passed_by_kind"] == {
        # payload registered, pinned, on the device (the host on a CPU), and ids always sorted
        "gather": 4 * len(cases),
        "decompress": len(cases),
        "pooled": 4 * (floating + 1),  # SUM/MEAN x weights or not; + the int8 row-wise table
        "table_set": 4,  # SUM/MEAN x weights or not, every part against its table's own op
        "errors": 3,
    }
    assert correctness["passed"] == sum(correctness["passed_by_kind"].values())
    served = phases["served"]
    assert served["failures"] == [] and served["passed"] == 3 * 3 * 3  # steps x poolings x B
    for r in gpu_check.TIMING_ORDER:
        timing = phases[f"timing_{r}"]
        assert timing["checks"] == {"passed": 2, "failures": []} and timing["rc"] == 0
    assert {row["row_bytes"] for row in report["results"]} == set(gpu_check.ROW_BYTES)
    assert {row["variant"] for row in report["results"]} == {"base", "thp"}
    assert report["targets"] == {} and report["sort_rule"] == []  # nothing GPU-side was timed
    for row in report["results"]:  # what a GPU run compares its timings with
        assert row["raw_wire_sectors"] == row["unique_ids"] * row["row_bytes"] // 32
        assert row["unique_ids"] <= row["ibp_wire_sectors"] <= row["raw_wire_sectors"] * 2


def test_a_fault_in_correctness_reruns_it_with_synchronous_staging(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    argv = ["--dry-run", "--out", str(out), "--only", "correctness,h2d"]
    assert gpu_check.main([*argv, "--inject-fault", "correctness"]) == 1
    phases = json.loads(out.read_text())["phases"]
    assert "illegal memory access" in phases["correctness"]["fault"]
    assert phases["correctness"]["rc"] == 1
    assert phases["correctness_sync"]["phase"] == "correctness"  # the rerun ran
    assert phases["h2d"]["rc"] == 0  # and the phases after it still ran
    failed = json.loads(out.read_text())["failed_phases"]
    assert failed == ["correctness", "correctness_sync"]


def test_a_failed_registration_makes_later_phases_use_pinned_copies(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    argv = ["--dry-run", "--out", str(out), "--only", "preflight,h2d"]
    assert gpu_check.main([*argv, "--inject-fault", "preflight"]) == 1
    phases = json.loads(out.read_text())["phases"]
    assert phases["preflight"]["fault"] and phases["preflight"]["pin"] == "register"
    assert phases["h2d"]["pin"] == "copy" and phases["h2d"]["rc"] == 0


def test_past_the_deadline_phases_are_skipped_and_the_report_written(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--deadline-s", "0"]) == 0
    report = json.loads(out.read_text())
    skipped = [key for key, p in report["phases"].items() if "deadline" in p.get("skipped", "")]
    assert "correctness" in skipped and "timing_512" in skipped
    assert report["results"] == []


def test_unknown_phases_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown phases"):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "x.json"), "--only", "timings"])


def test_slot_sectors_counts_each_rows_sectors() -> None:
    big = gpu_check.build_big(ibpembed, gpu_check.Pinned(False), 64, 1 << 20, "dlrm", False)
    _, block_base, row_units = big.comp_cpu[:3]
    ids = torch.tensor([0, 1, 31, 32, 33, 100, big.num_rows - 1])
    want = 0
    for r in ids.tolist():
        start = r - r % 32
        offset = int(block_base[r // 32]) + big.unit_bytes * int(row_units[start:r].sum())
        size = big.unit_bytes * int(row_units[r])
        want += (offset % 32 + size + 31) // 32
    assert gpu_check.slot_sectors(big, ids) == want


def test_gpu_times_runs_every_method_on_the_cpu_ops() -> None:
    # The GPU-only timing code, on the CPU ops: every method runs and is timed (the times mean
    # nothing here; the environment switches they flip are ignored by the CPU ops).
    big = gpu_check.build_big(ibpembed, gpu_check.Pinned(False), 256, 1 << 20, "dlrm", False)
    ids = torch.arange(0, big.num_rows, 7)[:512]
    offsets = torch.arange(0, ids.numel() + 1, gpu_check.BAG_SIZE)
    times = gpu_check.gpu_times(ibpembed._ops.ops, big, ids, offsets, gpu=False)
    assert set(times) == {
        "ibp_none",
        "ibp_none_sync",
        "ibp_none_sorted",
        "ibp_none_nosort",
        "raw_none",
        "ibp_sum",
        "ibp_sum_deferred",
        "raw_sum",
    }  # no uva: the baseline is not loaded here
    assert all(t > 0 for t in times.values())


def test_a_stopped_driver_ends_the_running_phase_tree(tmp_path: Path) -> None:
    args = argparse.Namespace(
        deadline_s=60.0,
        profile="dlrm",
        only=None,
        dry_run=True,
        table_gib=8.0,
        zipf="1.2",
        inject_fault=None,
        skip_build=False,
    )
    driver = gpu_check.Driver(args, tmp_path / "gpu_check.json", gpu=False)
    # A phase's tree: a shell in a session of its own with a child of its own.
    driver.child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    with pytest.raises(SystemExit, match="signal 15"):
        driver.stop(signal.SIGTERM, None)
    assert driver.child.wait(timeout=10) != 0
    assert running_in_group(driver.child.pid) == []  # the grandchild too (zombies aside)


def running_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are not zombies (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            found.append(int(stat.parent.name))
    return found
