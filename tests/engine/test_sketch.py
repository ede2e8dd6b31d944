# SPDX-License-Identifier: Apache-2.0
"""The count-min sketch behind the hot tier's admission: never under its true counts (or its
saturation), close on skewed traffic, and forgetting old traffic by halving."""

from __future__ import annotations

import numpy as np
import pytest

from ibpembed.engine.sketch import CAP, DEPTH, MAX_WIDTH, MIN_WIDTH, FrequencySketch


def test_estimates_never_fall_below_the_true_counts_and_stay_close_on_zipf() -> None:
    rng = np.random.default_rng(0)
    ids = (rng.zipf(1.1, 200_000) * 7919).astype(np.int64)  # spread, not 0..n
    sketch = FrequencySketch(4096, sample=10**9)  # no halving here
    distinct, counts = np.unique(ids, return_counts=True)
    sketch.add(distinct, counts)
    estimates = sketch.estimate(distinct).astype(np.int64)
    assert (estimates >= np.minimum(counts, CAP)).all()
    assert estimates.max() == CAP and counts.max() > CAP  # the head saturates
    # Count-min's bound: over by at most e x ids / width (with probability 1 - e^-DEPTH each).
    assert (estimates - counts <= np.e * ids.size / sketch.width).mean() > 0.95
    edge = np.argsort(-counts)[100:200]  # below the head: what a tier's edge ranks
    assert (counts[edge] < CAP).all()
    assert (estimates[edge] - counts[edge] <= np.e * ids.size / sketch.width).all()
    assert FrequencySketch(4096, sample=1).estimate(np.array([-1, 3])).tolist() == [0, 0]


def test_adding_one_at_a_time_equals_adding_with_counts() -> None:
    ids = np.array([5, 9, 5, 5, 2**40, 9], np.int64)
    one = FrequencySketch(1024, sample=10**6)
    for i in ids:
        one.add(np.array([i]))
    counted = FrequencySketch(1024, sample=10**6)
    distinct, counts = np.unique(ids, return_counts=True)
    counted.add(distinct, counts)
    assert np.array_equal(one.counts, counted.counts)
    assert counted.estimate(np.array([5, 9, 2**40])).tolist() == [3, 2, 1]


def test_halving_ages_out_old_traffic() -> None:
    sketch = FrequencySketch(1024, sample=100)
    sketch.add(np.array([1], np.int64), np.array([80]))
    assert sketch.estimate(np.array([1])).tolist() == [80]
    sketch.add(np.array([2], np.int64), np.array([30]))  # 110 >= 100 increments: halve
    assert sketch.estimate(np.array([1, 2])).tolist() == [40, 15]
    assert sketch.added == 55
    for _ in range(4):  # the new favourite overtakes the old one
        sketch.add(np.array([2], np.int64), np.array([30]))
    one, two = sketch.estimate(np.array([1, 2])).tolist()
    assert two > one


def test_counters_saturate_instead_of_wrapping_and_shared_counters_add_up() -> None:
    sketch = FrequencySketch(1024, sample=10**9)
    for _ in range(3):
        sketch.add(np.array([7], np.int64), np.array([200]))
    assert sketch.estimate(np.array([7])).tolist() == [CAP]
    # 5,000 distinct ids on 1,024 counters a row share counters: none of their increments is lost.
    crowded = FrequencySketch(1024, sample=10**9)
    crowded.add(np.arange(5000, dtype=np.int64) * 7919, np.full(5000, 2))
    assert crowded.counts.max() < CAP
    assert crowded.counts.sum(axis=1, dtype=np.int64).tolist() == [10_000] * DEPTH


@pytest.mark.parametrize(("asked", "width"), [(1, MIN_WIDTH), (5000, 8192), (10**9, MAX_WIDTH)])
def test_width_is_a_bounded_power_of_two(asked: int, width: int) -> None:
    sketch = FrequencySketch(asked, sample=1)
    assert sketch.width == width and sketch.nbytes == DEPTH * width
    with pytest.raises(ValueError, match="sample"):
        FrequencySketch(asked, sample=0)
