# SPDX-License-Identifier: Apache-2.0
"""kill -9 at several moments of a pack: the previous table set (or file) stays intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ibpembed.tables import atomic
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST, read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore

REPO = Path(__file__).resolve().parents[2]

# The child packs version 2 and stops dead at the chosen point, announcing it on stdout; the
# parent then SIGKILLs it, so the kill lands exactly there (no timing guesses).
_CHILD = r"""
import os, sys, time
import torch
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.pack import pack_table_set

target, point = sys.argv[1], sys.argv[2]
tw.PACK_STEP_BYTES = 4096  # many steps: the kill lands mid-payload


def hang():
    print("ready", flush=True)
    time.sleep(3600)


def progress(source):
    def step(rows):
        if point == "payload" and source.name == "b":
            hang()
    return step


def on_table(packed):
    if point == "between_tables":
        hang()


real_replace = os.replace


def replace(src, dst):
    if point == "manifest_rename" and str(dst).endswith("manifest.json"):
        hang()
    real_replace(src, dst)


os.replace = replace
tables = (TableSource("a", torch.full((2000, 8), 2.0)), TableSource("b", torch.full((900, 4), 2.0)))
if point == "single_file":
    tw.pack_table(target, tables[0].weight, name="a", progress=lambda rows: hang())
else:
    pack_table_set(target, TableSet(tables), progress=progress, on_table=on_table)
"""


def version_set(value: float) -> TableSet:
    return TableSet(
        (
            TableSource("a", torch.full((2000, 8), value)),
            TableSource("b", torch.full((900, 4), value)),
        )
    )


def kill_child_at(target: Path, point: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(target), point],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    if line.strip() != "ready":
        child.kill()
        pytest.fail(f"child never reached {point}: {child.communicate()[1]}")
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("point", ["payload", "between_tables", "manifest_rename"])
def test_kill_during_pack_keeps_the_previous_set(tmp_path: Path, point: str) -> None:
    directory = tmp_path / "set"
    pack_table_set(directory, version_set(1.0))
    before = (directory / MANIFEST).read_bytes()
    kill_child_at(directory, point)
    # The previous manifest is untouched and everything it names loads and verifies.
    assert (directory / MANIFEST).read_bytes() == before
    store = TableStore.load(directory, verify=True)
    with store.acquire() as snap:
        for table in snap.tables.values():
            assert bool((table.decompress() == 1.0).all())
    # Nothing under a final name is partial: every visible table file is complete.
    for path in directory.glob("*.ibpt"):
        tf.verify_file(path)
    # The next pack succeeds and sweeps what the killed one left behind.
    pack_table_set(directory, version_set(3.0))
    names = {p.name for p in directory.iterdir()}
    live = {e.file for e in read_manifest(directory).tables.values()}
    assert names == {MANIFEST, ".pack.lock", *live}


def test_kill_during_single_file_pack_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "a.ibpt"
    tw.pack_table(path, torch.full((100, 8), 1.0), name="a")
    before = path.read_bytes()
    kill_child_at(path, "single_file")
    assert path.read_bytes() == before
    tf.verify_file(path)
    leftovers = [p.name for p in tmp_path.iterdir() if p != path]
    assert leftovers and all(n.startswith(".") and atomic.TEMP_MARKER in n for n in leftovers)
