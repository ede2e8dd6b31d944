# SPDX-License-Identifier: Apache-2.0
"""examples/movielens_dlrm.py runs end to end on its --quick slice of real MovieLens-100k."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torchrec.models.dlrm", reason="torchrec is not installed")
if importlib.util.find_spec("recbole") is None:
    pytest.skip(
        "MovieLens-100k ships in the recbole wheel, which is not installed "
        "(pip install --no-deps recbole==1.2.1)",
        allow_module_level=True,
    )

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "movielens_dlrm.py"


def test_movielens_dlrm_quick(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("movielens_dlrm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--quick"])
    assert results["rows_bit_exact"] == 1.0
    assert results["pooled_within_bound"] == 1.0
    assert results["pooled_max_abs_delta"] <= results["pooled_max_bound"]
    # Logits move by ~1e-7 at most, so only near-tied pairs could swap; each swap moves the AUC
    # by 1 / (positives x negatives), about 2e-5 on the 500-rating test slice.
    assert results["auc_before"] == pytest.approx(results["auc_after"], abs=1e-6)
    assert results["stored_bytes"] > 0 and results["raw_bytes"] == 171_456
    out = capsys.readouterr().out
    assert "sparse_arch.embedding_bag_collection.t_item_id" in out
    assert "host bytes saved" in out
