# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check --dry-run: the GPU script's driver and the CPU half of its phases, so
they do not rot between the rare runs on a GPU machine (the build's plan, the preflight's
mappings, table tiling and the raw layout checked against the CPU decoder, the output folder's
file count; a fault, a failed registration and the deadline take the branches they take on the
GPU).

With no GPU the correctness checks compare the CPU ops with independent answers (the source rows
for gathers and decompression, ``ibpembed.reference`` for pooled lookups), so a wrong CPU op fails
here: the counts below are those real checks, every one of them run and passed."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

import ibpembed
from benchmarks.gpu_check import build, driver, hbm_tier, markdown, summary, tables, timing
from benchmarks.gpu_check.common import ROW_BYTES
from benchmarks.gpu_check.correctness import small_cases
from benchmarks.gpu_check.device import Pinned

MAX_FILES_BACK = 8  # what a GPU run returns from its output folder


def test_dry_run_runs_every_phase_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert driver.main(["--dry-run", "--profile", "dlrm-bf16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    phases = report["phases"]
    timings = [*(f"timing_{r}" for r in driver.TIMING_ORDER), "timing_real", "timing_512_thp"]
    # In this order, as the deadline cuts from the end: the 512-byte timing the targets are
    # judged at, the HBM tier, the rest of the sweep, then the sanitizer.
    assert list(phases) == ["build", "preflight", "correctness", "served", "h2d", timings[0],
                            "hbm_tier", *timings[1:], "sanitizer"]  # fmt: skip
    assert phases["sanitizer"] == {"skipped": "no GPU"}
    assert report["failed_phases"] == []
    built = phases["build"]  # planned up to the compilers, for the GPU machine's sm_90
    assert built["cuda_archs"] == "90" and built["stopped_before"].startswith("compiling")
    assert built["route"] == "setup.py" and built["rc"] == 0
    pre = phases["preflight"]  # a shared mapping faulted in adds no anonymous memory
    assert pre["shared_stays_in_place"] and pre["shared"]["prefault_anonymous_added"] < 1 << 20
    correctness = phases["correctness"]
    assert correctness["failures"] == [] and correctness["fault"] is None
    assert correctness["against"] == "source rows and ibpembed.reference"
    cases = [table for _, table, _ in small_cases()]
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
    tier = phases["hbm_tier"]  # every Zipf x budget x form, emulated against the CPU op
    cases = len(hbm_tier.ZIPF) * (len(hbm_tier.BUDGETS) - 1) * len(hbm_tier.FORMS)
    assert tier["checks"] == {"passed": cases, "failures": []} and tier["rc"] == 0
    for row in tier["hbm_tier"]:
        assert 0 < row["hit_share"] < 1 and row["tier_rows"] > 0
    by_case = {(r["ids"], r["budget"], r["form"]): r for r in tier["hbm_tier"]}
    for alpha in hbm_tier.ZIPF:  # more budget holds more rows and serves more reads
        shares = [
            by_case[(f"zipf{alpha}", b, "decoded")]["hit_share"] for b in hbm_tier.BUDGETS[1:]
        ]
        assert shares == sorted(shares)
        # The compressed form holds more rows in the same bytes.
        for b in hbm_tier.BUDGETS[1:]:
            decoded, compressed = (by_case[(f"zipf{alpha}", b, f)] for f in hbm_tier.FORMS)
            assert compressed["tier_rows"] > decoded["tier_rows"]
    assert "HBM tier (`--hbm-tier`)" in markdown.section(report)
    served = phases["served"]
    assert served["failures"] == [] and served["passed"] == 3 * 3 * 3  # steps x poolings x B
    for key in timings:
        timing_phase = phases[key]
        # tiled, raw and line-aware layouts against the plain rows (the real table: no line-aware)
        passed = 2 if key == "timing_real" else 3
        assert timing_phase["checks"] == {"passed": passed, "failures": []}
        assert timing_phase["rc"] == 0
    assert phases["timing_real"]["source"].startswith("minilm_words.ibpt")
    assert {row["row_bytes"] for row in report["results"]} == {*ROW_BYTES, 1536}
    assert {row["variant"] for row in report["results"]} == {"base", "real", "thp"}
    assert report["targets"] == {} and report["sort_rule"] == []  # nothing GPU-side was timed
    for row in report["results"]:  # what a GPU run compares its timings with
        assert row["raw_wire_sectors"] == row["unique_ids"] * row["row_bytes"] // 32
        assert row["unique_ids"] <= row["ibp_wire_sectors"] <= row["raw_wire_sectors"] * 2
        if row["variant"] != "real":  # padding up to a sector boundary adds no sector
            assert row["unique_ids"] <= row["line_wire_sectors"] <= row["ibp_wire_sectors"]
        assert set(row["seconds"]) == {"cpu_h2d", "h2d_batch"} and row["event_seconds"] == {}
    assert report["machine"]["kernel"] and "thp_enabled" in report["machine"]
    # The output folder: the merged report and one tarball of every phase's file.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_check.json",
        "gpu_check_phases.tar.gz",
    ]
    with tarfile.open(tmp_path / "gpu_check_phases.tar.gz") as tar:
        names = {Path(n).stem for n in tar.getnames()}
    assert names == set(phases) - {"sanitizer"}  # the sanitizer ran no child here


def test_every_run_leaves_few_files_in_its_output_folder(tmp_path: Path) -> None:
    # Reruns and failures included: the correctness rerun adds a phase, not a file.
    out = tmp_path / "gpu_check.json"
    for fault in ("correctness", None):
        argv = ["--dry-run", "--out", str(out), "--only", "correctness,h2d"]
        driver.main([*argv, *(["--inject-fault", fault] if fault else [])])
        assert len(list(tmp_path.iterdir())) <= MAX_FILES_BACK - 2  # room for the log and env


def test_a_fault_in_correctness_reruns_it_with_synchronous_staging(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    argv = ["--dry-run", "--out", str(out), "--only", "correctness,h2d"]
    assert driver.main([*argv, "--inject-fault", "correctness"]) == 1
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
    assert driver.main([*argv, "--inject-fault", "preflight"]) == 1
    phases = json.loads(out.read_text())["phases"]
    assert phases["preflight"]["fault"] and phases["preflight"]["pin"] == "register"
    assert phases["h2d"]["pin"] == "copy" and phases["h2d"]["rc"] == 0


def test_past_the_deadline_phases_are_skipped_and_the_report_written(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert driver.main(["--dry-run", "--out", str(out), "--deadline-s", "0"]) == 0
    report = json.loads(out.read_text())
    skipped = [key for key, p in report["phases"].items() if "deadline" in p.get("skipped", "")]
    assert {"build", "correctness", "timing_512", "timing_real"} <= set(skipped)
    assert report["results"] == []


def test_unknown_phases_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown phases"):
        driver.main(["--dry-run", "--out", str(tmp_path / "x.json"), "--only", "timings"])


def test_the_build_plans_only_the_archs_asked_for() -> None:
    plan = build.plan("90")
    assert plan.gencode == ["-gencode=arch=compute_90,code=sm_90"]
    assert any(s.endswith(".cu") for s in plan.load_sources)
    assert plan.env["IBPEMBED_CUDA_ARCHS"] == "90"
    assert len(build.plan("80,90").gencode) == 2


def test_slot_sectors_counts_each_rows_sectors() -> None:
    big = tables.build_big(ibpembed, Pinned(False), 64, 1 << 20, "dlrm", False)
    _, block_base, row_units = big.comp_cpu[:3]
    ids = torch.tensor([0, 1, 31, 32, 33, 100, big.num_rows - 1])
    want = 0
    for r in ids.tolist():
        start = r - r % 32
        offset = int(block_base[r // 32]) + big.unit_bytes * int(row_units[start:r].sum())
        size = big.unit_bytes * int(row_units[r])
        want += (offset % 32 + size + 31) // 32
    assert timing.slot_sectors(big, ids) == want


def test_the_real_table_tiles_to_its_own_rows() -> None:
    big = tables.build_big(ibpembed, Pinned(False), 0, 64 << 20, "dlrm", False, real=True)
    assert big.row_bytes == 1536 and big.num_rows % 32 == 0 and big.num_rows > 13000
    ids = torch.tensor([0, 1, 12991, 12992, big.num_rows - 1])
    got = ibpembed._ops.ops.ibp_gather(*big.comp_cpu, ids)
    assert torch.equal(got, big.plain[ids])
    assert torch.equal(big.plain[12992], big.plain[0])  # the second copy of the tile
    assert 1.05 < big.ratio_stored < 1.5  # real fp32 word embeddings compress a little


def test_gpu_times_runs_every_method_on_the_cpu_ops() -> None:
    # The GPU-only timing code, on the CPU ops: every method runs and is timed (the times mean
    # nothing here; the environment switches they flip are ignored by the CPU ops).
    big = tables.build_big(ibpembed, Pinned(False), 256, 1 << 20, "dlrm", False)
    ids = torch.arange(0, big.num_rows, 7)[:512]
    offsets = torch.arange(0, ids.numel() + 1, 16)
    times = timing.gpu_times(ibpembed._ops.ops, big, ids, offsets, gpu=False)
    assert set(times) == {
        "ibp_none",
        "ibp_none_sync",
        "ibp_none_sorted",
        "ibp_none_nosort",
        "ibp_copy",
        "ibp_line",
        "raw_none",
        "ibp_sum",
        "ibp_sum_deferred",
        "raw_sum",
    }  # no uva: the baseline is not loaded here; no torch_uva: no device alias
    assert all(t.wall_s > 0 and t.event_s is None for t in times.values())


def fake_row(batch: int, ibp_s: float, raw_s: float) -> dict:
    seconds = {"ibp_none": 1.0, "raw_none": 1.0, "ibp_copy": 1.0, "ibp_sum": 1.0, "cpu_h2d": 2.0}
    return {
        "row_bytes": 512,
        "batch": batch,
        "ids": "uniform",
        "seconds": seconds,  # the wall clock, which the verdict must not read
        "event_seconds": {"ibp_none": ibp_s, "raw_none": raw_s, "ibp_copy": ibp_s / 2},
        "raw_bytes": batch * 512,
        "raw_wire_bytes": batch * 512,
        "ibp_wire_bytes": batch * 450,
        "raw_wire_sectors": batch * 16,
        "ibp_wire_sectors": batch * 15,
    }


def test_compressed_vs_raw_is_judged_by_kernel_time_at_16k_ids_and_more() -> None:
    slow = [fake_row(n, ibp_s=2.0, raw_s=1.0) for n in (1024, 4096)]  # reported, not judged
    fast = [fake_row(n, ibp_s=1.0, raw_s=1.2) for n in (16384, 65536)]
    h2d = {"wall": 50.0, "event": 55.0}
    targets = summary.summarise([*slow, *fast], h2d)
    assert targets["compressed_vs_raw"] == {"met": True, "judged": 2, "misses": []}
    assert [row["ibp_vs_raw"] for row in slow] == [0.5, 0.5]  # still in the rows
    assert all(row["decode_cost"] == 2.0 for row in [*slow, *fast])
    missed = summary.summarise([fake_row(65536, ibp_s=2.0, raw_s=1.0)], h2d)
    assert missed["compressed_vs_raw"]["misses"] == ["R=512 n=65536 uniform"]
    # 512 B x 64k ids in 1 s of kernel time is far below 0.6 x 55 GB/s.
    assert missed["raw_vs_h2d"]["misses"] == ["R=512 n=65536 uniform: 0.00 of H2D"]


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
    d = driver.Driver(args, tmp_path / "gpu_check.json", gpu=False)
    # A phase's tree: a shell in a session of its own with a child of its own.
    d.child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    with pytest.raises(SystemExit, match="signal 15"):
        d.stop(signal.SIGTERM, None)
    assert d.child.wait(timeout=10) != 0
    assert running_in_group(d.child.pid) == []  # the grandchild too (zombies aside)
    d.phase_dir.rmdir()


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


def test_a_gpu_report_renders_into_the_gpu_section(tmp_path: Path) -> None:
    from benchmarks import report

    rows = [fake_row(n, ibp_s=1e-3, raw_s=1.1e-3) for n in (1024, 65536)]
    h2d = {"wall": 50.0, "event": 55.0}
    data = {
        "machine": {
            "gpu": "NVIDIA H200",
            "date": "2026-12-01T15:00:00+00:00",
            "nvidia_smi": {"driver_version": "580.159.04", "pcie.link.gen.max": "5"},
        },
        "command": "python -m benchmarks.gpu_check --deadline-s 490 --out /out/gpu_check.json",
        "phases": {"h2d": {"h2d_gbps": h2d, "child_wall_s": 9.0}},
        "targets": summary.summarise(rows, h2d),
        "results": rows,
        "failed_phases": [],
    }
    (tmp_path / "gpu_check.json").write_text(json.dumps(data))
    text = report.render(tmp_path, {})
    gpu = text[text.index('<a id="gpu_check">') :]
    assert "**NVIDIA H200**" in gpu and "2026-12-01T15:00:00+00:00" in gpu
    assert "`python -m benchmarks.gpu_check --deadline-s 490" in gpu
    assert "driver 580.159.04, PCIe Gen5" in gpu and "55.0 GB/s by CUDA events" in gpu
    assert "| 512 | 65536 | uniform |" in gpu  # the GB/s table
    assert "Not measured" not in gpu
    headline = text[text.index("## Headline") : text.index('<a id="codec">')]
    assert "(512 B, 64k ids, NVIDIA H200) | 33.6 GB/s | 30.5 GB/s | 1.10× |" in headline
