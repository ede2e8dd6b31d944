# SPDX-License-Identifier: Apache-2.0
"""The ref, bmi2 and avx512 CPU paths (the last with each of its pattern lookups) produce
identical bytes; the path is chosen at load time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C, compress, cpu_path
from ibpembed._ops import ops
from ibpembed.codec import available_cpu_paths, pattern_lookup, serve_payload_bytes
from tests.codec.tables import same_bits, stage_min_bytes_kept, tables

FAST_PATHS = [
    pytest.param(p, marks=pytest.mark.skipif(p not in available_cpu_paths(), reason=f"no {p}"))
    for p in ("bmi2", "avx512")
]
# The avx512 path's codebook decoder with each pattern lookup (bmi2 has none: either name runs
# the same decoder).
FAST_DECODERS = [
    pytest.param(
        path, lookup, marks=pytest.mark.skipif(path not in available_cpu_paths(), reason=path)
    )
    for path, lookup in (("bmi2", "gather"), ("avx512", "gather"), ("avx512", "tables"))
]


@pytest.fixture
def restore_lookup() -> Iterator[None]:
    before = pattern_lookup()
    yield
    _C.set_pattern_lookup(before)


@pytest.mark.parametrize(("path", "lookup"), FAST_DECODERS)
@given(
    table=tables(),
    chunk_bits=st.sampled_from((16, 32, 64)),
    code_bits=st.sampled_from((1, 2, 3, 4)),
    seed=st.integers(0, 2**32 - 1),
)
def test_fast_paths_match_the_reference_path(
    path, lookup, table, chunk_bits, code_bits, seed
) -> None:
    """Same bytes from both encoders; each decoder reads what the other wrote. The gather takes
    256 ids: several rounds of the decode pipeline."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, table.shape[0], 256))
    before, lookup_before = cpu_path(), pattern_lookup()
    try:
        _C.set_pattern_lookup(lookup)
        _C.set_cpu_path("ref")
        c_ref = compress(table, chunk_bits=chunk_bits, code_bits=code_bits)
        rows_ref = c_ref.decompress()
        _C.set_cpu_path(path)
        c_fast = compress(table, chunk_bits=chunk_bits, code_bits=code_bits)
        rows_fast = c_fast.decompress()
        cross = (c_ref.decompress(), c_ref.gather(ids))  # the fast path decoding what ref wrote
        _C.set_cpu_path("ref")
        cross_back = c_fast.gather(ids)
    finally:
        _C.set_cpu_path(before)
        _C.set_pattern_lookup(lookup_before)
    assert torch.equal(c_ref.payload, c_fast.payload)
    assert torch.equal(c_ref.bitmask, c_fast.bitmask)
    assert same_bits(rows_ref, table) and same_bits(rows_fast, table)
    assert same_bits(cross[0], table)
    assert same_bits(cross[1], table[ids]) and same_bits(cross_back, table[ids])


def test_default_path_is_the_fastest_the_cpu_runs() -> None:
    # The CPU's own feature bits, read independently of available_cpu_paths. Where pdep is
    # microcoded (AMD Zen 1/2) the portable path is the faster one.
    fast_pdep = _C.cpu_has_bmi2() and not _C.cpu_has_microcoded_pdep()
    expected = "avx512" if _C.cpu_has_avx512() else "bmi2" if fast_pdep else "ref"
    assert cpu_path() == expected == available_cpu_paths()[0] == _C.default_cpu_path()


def test_default_pattern_lookup_is_the_gather_on_intel_cpus_without_gds_microcode() -> None:
    # The vendor and the Gather Data Sampling status read independently of the extension.
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        intel = "GenuineIntel" in f.read()
    gds = Path("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling")
    slowed = gds.exists() and gds.read_text().startswith("Mitigation: Microcode")
    assert _C.default_pattern_lookup() == ("gather" if intel and not slowed else "tables")
    assert pattern_lookup() == _C.default_pattern_lookup()


def _path_in_subprocess(
    value: str, code: str = "print(ibpembed.cpu_path())", variable: str = "IBPEMBED_CPU_PATH"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, variable: value}
    return subprocess.run(
        # The package loads the codec (and the extension) on first use: import it by name.
        [sys.executable, "-c", f"import ibpembed, ibpembed.codec; {code}"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_env_override_selects_ref() -> None:
    result = _path_in_subprocess("ref")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ref"


def test_env_override_rejects_unknown_values_at_import() -> None:
    result = _path_in_subprocess("avx9000", code="pass")
    assert result.returncode != 0
    assert "IBPEMBED_CPU_PATH must be 'ref', 'bmi2' or 'avx512'" in result.stderr


def test_set_cpu_path_validates(restore_path) -> None:
    with pytest.raises(ValueError, match="'ref', 'bmi2' or 'avx512'"):
        _C.set_cpu_path("fast")


def test_pattern_lookup_env_override() -> None:
    code = "print(ibpembed.codec.pattern_lookup())"
    result = _path_in_subprocess("tables", code=code, variable="IBPEMBED_PATTERN_LOOKUP")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tables"
    bad = _path_in_subprocess("scatter", code="pass", variable="IBPEMBED_PATTERN_LOOKUP")
    assert bad.returncode != 0
    assert "IBPEMBED_PATTERN_LOOKUP must be 'gather' or 'tables'" in bad.stderr


def test_set_pattern_lookup_validates(restore_lookup) -> None:
    with pytest.raises(ValueError, match="'gather' or 'tables'"):
        _C.set_pattern_lookup("scatter")


def _random_layout(
    rows: torch.Tensor, chunk_bits: int, code_bits: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of random bits and codebooks of the masked bits of random rows: any layout the ops
    accept, with chunks that match a pattern and chunks that escape."""
    rng = np.random.default_rng(seed)
    n, row_bytes = rows.shape
    chunk_bytes = chunk_bits // 8
    v = -(-row_bytes // chunk_bytes)
    padded = np.zeros((n, v * chunk_bytes), np.uint8)
    padded[:, :row_bytes] = rows.numpy()
    chunks = padded.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[chunk_bytes]).astype(np.uint64)
    low = np.uint64((1 << chunk_bits) - 1)
    mask = rng.integers(0, 2**64 - 1, v, dtype=np.uint64, endpoint=True) & low
    k = (1 << code_bits) - 1
    bitval = chunks[rng.integers(0, n, (v, k)), np.arange(v)[:, None]] & mask[:, None]
    return torch.from_numpy(mask.view(np.int64)), torch.from_numpy(bitval.ravel().view(np.int64))


@pytest.mark.parametrize("path", FAST_PATHS)
@given(
    table=tables(),
    other=tables(),
    chunk_bits=st.sampled_from((16, 32, 64)),
    code_bits=st.sampled_from((1, 2, 3, 4)),
    seed=st.integers(0, 2**32 - 1),
)
def test_fast_paths_size_rows_like_the_reference_path(
    path, table, other, chunk_bits, code_bits, seed
) -> None:
    """Row sizes to the byte (the fit compares layouts by them), on rows the codebooks were
    drawn from and on foreign rows, where most chunks escape; odd widths end in a cut chunk."""
    u8 = table.view(torch.uint8).view(table.shape[0], -1)
    foreign = torch.from_numpy(
        np.resize(other.contiguous().view(torch.uint8).numpy().ravel(), u8.numel())
    ).view(u8.shape)
    mask, bitval = _random_layout(u8, chunk_bits, code_bits, seed)
    sizes = {}
    before = cpu_path()
    try:
        for p in ("ref", path):
            _C.set_cpu_path(p)
            sizes[p] = [ops.ibp_slot_bytes(r, chunk_bits, mask, bitval, 1) for r in (u8, foreign)]
    finally:
        _C.set_cpu_path(before)
    assert all(torch.equal(a, b) for a, b in zip(sizes["ref"], sizes[path], strict=True))


def test_stage_min_bytes_defaults_to_the_last_level_cache() -> None:
    # getconf asks glibc's sysconf, as the extension does; Python's os.sysconf lacks the name.
    got = subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True)
    l3 = int(got.stdout) if got.returncode == 0 and got.stdout.strip().isdigit() else 0
    if l3 <= 0:
        pytest.skip("the OS does not report a last-level cache size")
    assert _C.default_stage_min_bytes() == l3


def test_a_process_serving_more_than_the_cache_stages_tables_past_l2() -> None:
    llc = _C.default_stage_min_bytes()
    with stage_min_bytes_kept():
        serve_payload_bytes(llc + 1)
        staged_above = _C.stage_min_bytes()
        assert 0 < staged_above < llc
        serve_payload_bytes(llc)
        assert _C.stage_min_bytes() == llc
        with pytest.raises(ValueError, match=">= 0"):
            serve_payload_bytes(-1)


def test_stage_min_bytes_env_override() -> None:
    code = (
        "from ibpembed import _C, codec; codec.serve_payload_bytes(2**40); "
        "print(_C.stage_min_bytes())"
    )
    result = _path_in_subprocess("4096", code=code, variable="IBPEMBED_STAGE_MIN_BYTES")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4096"  # the override wins over what the process serves
    bad = _path_in_subprocess("lots", code="pass", variable="IBPEMBED_STAGE_MIN_BYTES")
    assert bad.returncode != 0
    assert "IBPEMBED_STAGE_MIN_BYTES must be a byte count >= 0, got 'lots'" in bad.stderr
