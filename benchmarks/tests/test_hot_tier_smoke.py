# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.hot_tier: the quick run times every engine at every tier budget on
the same ids (the run itself checks that every ibpembed engine returns the raw rows' sums bit
for bit), reports hit ratios and host bytes, and renders into BENCHMARKS.md's section."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import __main__ as runner
from benchmarks import hot_tier


def test_quick_run_reports_every_engine_and_budget(tmp_path: Path) -> None:
    assert hot_tier.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "hot_tier.json").read_text())
    runs = report["results"]
    assert {(r["dtype"], r["alpha"]) for r in runs} == {
        (d, a) for d in hot_tier.QUICK.dtypes for a in hot_tier.QUICK.alphas
    }
    tiers = [hot_tier.tier_label(b) for b in hot_tier.BUDGETS]
    for r in runs:
        rates = r["mlookups_per_s"]
        assert {hot_tier.COMPRESSED, hot_tier.RAW, "F.embedding_bag", *tiers} <= set(rates)
        assert all(rate > 0 for rate in rates.values())
        assert set(r["host_bytes"]) == set(rates)
        hits = [r["hit_ratio"][t] for t in tiers]
        assert hits == sorted(hits) and hits[-1] == 1.0  # larger budgets serve more
        sizes = [r["host_bytes"][t] for t in tiers]
        assert sizes == sorted(sizes)
    assert (tmp_path / "hot_tier.png").is_file()
    assert runner.main(["--render-only", "--out", str(tmp_path), "--report",
                        str(tmp_path / "B.md")]) == 0  # fmt: skip
    section = (tmp_path / "B.md").read_text().split("## Hot tier")[1].split("\n## ")[0]
    assert "| engine | host GiB fp32 | host GiB bf16 |" in section
    assert "Not measured" not in section
