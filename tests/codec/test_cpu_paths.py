# SPDX-License-Identifier: Apache-2.0
"""The reference and BMI2 paths produce identical bytes; the path is chosen at load time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C, compress, cpu_path
from tests.codec.tables import same_bits, tables

needs_bmi2 = pytest.mark.skipif(not _C.cpu_has_bmi2(), reason="this CPU has no BMI2")


@pytest.fixture
def restore_path() -> Iterator[None]:
    before = cpu_path()
    yield
    _C.set_cpu_path(before)


@needs_bmi2
@given(table=tables(), chunk_bits=st.sampled_from((16, 32, 64)))
def test_ref_and_bmi2_produce_identical_bytes(table, chunk_bits) -> None:
    before = cpu_path()
    try:
        _C.set_cpu_path("ref")
        c_ref = compress(table, chunk_bits=chunk_bits)
        rows_ref = c_ref.decompress()
        _C.set_cpu_path("bmi2")
        c_bmi2 = compress(table, chunk_bits=chunk_bits)
        rows_bmi2 = c_bmi2.decompress()
        rows_cross = c_ref.decompress()  # bmi2 decoding what ref encoded
    finally:
        _C.set_cpu_path(before)
    assert torch.equal(c_ref.payload, c_bmi2.payload)
    assert torch.equal(c_ref.bitmask, c_bmi2.bitmask)
    assert same_bits(rows_ref, table) and same_bits(rows_bmi2, table)
    assert same_bits(rows_cross, table)


def test_default_path_follows_the_cpu() -> None:
    assert cpu_path() == ("bmi2" if _C.cpu_has_bmi2() else "ref")


def _path_in_subprocess(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IBPEMBED_CPU_PATH": value}
    return subprocess.run(
        [sys.executable, "-c", "import ibpembed; print(ibpembed.cpu_path())"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_env_override_selects_ref() -> None:
    result = _path_in_subprocess("ref")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ref"


def test_env_override_rejects_unknown_values() -> None:
    result = _path_in_subprocess("avx9000")
    assert result.returncode != 0
    assert "IBPEMBED_CPU_PATH must be 'ref' or 'bmi2'" in result.stderr


def test_set_cpu_path_validates(restore_path) -> None:
    with pytest.raises(ValueError, match="'ref' or 'bmi2'"):
        _C.set_cpu_path("fast")
