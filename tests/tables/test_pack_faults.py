# SPDX-License-Identifier: Apache-2.0
"""Packing onto a full disk, in process (reliability.faults runs the same case end to end): the
failed version leaves no file behind and the previous set stays whole."""

from __future__ import annotations

import contextlib
import errno
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """RLIMIT_FSIZE for this process: writes past ``limit`` fail with EFBIG, as on a full disk.

    Python ignores SIGXFSZ, so the write raises instead of killing the process; only the soft
    limit is lowered, so it can be put back.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def small_then_big(version: int) -> TableSet:
    gen = torch.Generator().manual_seed(version)
    return TableSet(
        (
            TableSource("small", torch.randn(200, 8, generator=gen)),
            TableSource("big", torch.randn(20_000, 64, generator=gen)),  # ~5 MiB, incompressible
        )
    )


def test_pack_that_fills_the_disk_keeps_the_previous_set_and_leaves_no_file(tmp_path: Path):
    # The disk fills on the second table: the first one's file of the failed version is complete
    # but named by no manifest, so the failed pack removes it rather than leave it to the next
    # successful one.
    directory = tmp_path / "set"
    pack_table_set(directory, small_then_big(1))
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with file_size_limit(1 << 20), pytest.raises(OSError) as info:
        pack_table_set(directory, small_then_big(2))
    assert info.value.errno == errno.EFBIG
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    store = TableStore.load(directory, verify=True)
    with store.acquire() as snap:
        assert torch.equal(snap.tables["small"].decompress(), small_then_big(1).tables[0].weight)


def test_failed_first_pack_leaves_no_table_file(tmp_path: Path):
    directory = tmp_path / "set"
    with file_size_limit(1 << 20), pytest.raises(OSError):
        pack_table_set(directory, small_then_big(1))
    assert not (directory / MANIFEST).exists()
    assert not list(directory.glob("*.ibpt"))
