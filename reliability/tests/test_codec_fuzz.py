# SPDX-License-Identifier: Apache-2.0
"""A small run of the codec fuzz (reliability.fuzz_codec): same batches, same checks."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C
from ibpembed._ops import ops
from ibpembed.codec import available_cpu_paths
from reliability import fuzz_codec as fc


@given(index=st.integers(0, 2**31 - 1))
def test_fuzz_batch_round_trips_bit_exact(index: int) -> None:
    # The numpy reference is slow: one batch in four cross-checks one of its cases.
    every = 1 if index % 4 == 0 else 0
    plan = fc.JobPlan(
        job=0, jobs=1, seed=7, cases=1, solo_every=10, reference_every=every, failures=None
    )
    stats = fc.Stats()
    fc.run_batch(plan, index, stats)
    assert stats.mismatches == []
    assert stats.cases >= 1 and stats.rows >= stats.cases


def test_batches_cycle_through_every_decoder_and_restore_the_process_one() -> None:
    before = _C.cpu_path(), _C.pattern_lookup()
    plan = fc.JobPlan(
        job=0, jobs=1, seed=7, cases=1, solo_every=0, reference_every=0, failures=None
    )
    stats = fc.Stats()
    for index in range(len(fc.decoders())):
        fc.run_batch(plan, index, stats)
    expected = {f"{p}/{lookup}" if p == "avx512" else p for p, lookup in fc.decoders()}
    assert set(stats.by_cpu_path) == expected
    if "avx512" in available_cpu_paths():
        assert {"avx512/gather", "avx512/tables"} <= expected
    assert (_C.cpu_path(), _C.pattern_lookup()) == before


def test_checker_reports_a_corrupted_decode(monkeypatch) -> None:
    """The fuzz would say nothing if the comparison were vacuous: flip one bit, it must notice."""
    real = ops.ibp_decompress

    def corrupted(*args):
        out = real(*args).clone()
        out.view(-1)[0] ^= 1
        return out

    monkeypatch.setattr(fc.ops, "ibp_decompress", corrupted)
    seed = fc.batch_seed(0, 0)
    problems, _, _ = fc.check_batch(fc.make_batch(seed), seed)
    assert problems == ["decompress"]


def test_distributions_hold_what_they_promise() -> None:
    rng = np.random.default_rng(0)
    nan = torch.from_numpy(
        fc.make_values(rng, "nan_payloads", torch.float32, 50, 7).view(np.float32)
    )
    assert bool(nan.isnan().all())
    sub = fc.make_values(rng, "subnormals", torch.float16, 50, 7)
    assert not (sub & np.uint16(0x7C00)).any()  # exponent field zero: subnormals and zeros
    edge = fc.make_values(rng, "edge", torch.bfloat16, 400, 9)
    assert {0x0000, 0x8000, 0x7F80, 0xFF80} <= set(np.unique(edge).tolist())
    near = fc.make_values(rng, "near_invariant", torch.float32, 100, 16)
    assert (near != near[0]).mean() < 0.5
