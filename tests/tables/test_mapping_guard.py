# SPDX-License-Identifier: Apache-2.0
"""The SIGBUS guard of mapped table files: a read past the end of a file shortened in place
reads zeros and marks the table instead of killing the process; a mapping made before the guard
was enabled keeps the default (the process dies). Each case runs in a child process, so a guard
that fails kills the child, not the test run."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import mmap, os, sys
    import torch
    from ibpembed import codec
    from ibpembed.tables import format as fmt, mapping_guard
    from ibpembed.tables.writer import write_table

    guard_first = sys.argv[2] in ("guarded", "churn")
    if guard_first:
        mapping_guard.enable()
    values = torch.randn(20_000, 64, generator=torch.Generator().manual_seed(0))
    path = write_table(os.path.join(sys.argv[1], "t.ibpt"), codec.compress(values), name="t").path
    if sys.argv[2] == "churn":  # more mappings made and released than the guard has slots
        small = write_table(os.path.join(sys.argv[1], "s.ibpt"), codec.compress(values[:8]),
                            name="s").path
        for _ in range(5000):
            fmt.read_table(small).table.gather(torch.tensor([0]))
    table = fmt.read_table(path, prefetch=True).table
    if not guard_first:
        mapping_guard.enable()  # too late for the table mapped above
    assert torch.equal(table.gather(torch.arange(100)), values[:100])
    assert mapping_guard.faults() == 0 and not mapping_guard.faulted(table)
    os.truncate(path, os.path.getsize(path) // 2 // mmap.PAGESIZE * mmap.PAGESIZE)
    try:
        table.gather(torch.arange(values.shape[0]))
    except ValueError as err:  # zeros in place of slots and index entries: corrupt rows
        assert "corrupted table" in str(err), err
    assert mapping_guard.faults() >= 1 and mapping_guard.faulted(table)
    other = codec.compress(values[:10])  # in memory, never mapped: never suspect
    assert not mapping_guard.faulted(other)
    print("alive")
    """
)


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_guarded_mapping_reads_zeros_past_a_new_end_and_is_marked(tmp_path: Path) -> None:
    result = _run(tmp_path, "guarded")
    assert result.returncode == 0 and result.stdout.strip() == "alive", result.stderr


def test_released_mappings_give_their_slots_back(tmp_path: Path) -> None:
    result = _run(tmp_path, "churn")
    assert result.returncode == 0 and result.stdout.strip() == "alive", result.stderr
    assert "slot" not in result.stderr


def test_a_mapping_made_before_the_guard_keeps_the_default_and_the_process_dies(
    tmp_path: Path,
) -> None:
    result = _run(tmp_path, "unguarded")
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr)
