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


def test_targets_are_judged_from_the_runs_they_apply_to() -> None:
    """Each target's ratio comes from its own run; an unmeasured run adds no row."""

    def run(dtype: str, alpha: float, tier: float, compressed: float) -> dict:
        rates = {
            hot_tier.COMPRESSED: compressed,
            f"{hot_tier.COMPRESSED} + tier 10%": tier,
            hot_tier.RAW: 10.0,
            "torchrec EBC": 8.0,
            "F.embedding_bag": 12.5,
        }
        host = {name: 100 for name in rates}
        host[hot_tier.COMPRESSED] = 88
        return {"dtype": dtype, "alpha": alpha, "mlookups_per_s": rates, "host_bytes": host}

    rows = {
        what: (got, want) for what, got, want in hot_tier.targets([run("fp32", 1.05, 9.0, 3.0)])
    }
    tier = "compressed + the largest tier within raw rows' bytes (tier 10%), Zipf 1.05 fp32"
    assert rows[f"{tier}, vs raw rows"] == (0.9, 1.0)
    assert rows[f"{tier}, vs torchrec EBC"] == (9.0 / 8.0, 1.0)
    assert rows["compressed, no tier, vs raw rows, Zipf 1.05 fp32"] == (0.3, 0.6)
    assert rows["raw rows vs F.embedding_bag, Zipf 1.05 fp32"] == (0.8, 1.0)
    assert not any("uniform" in what or "bf16" in what for what in rows)
