# SPDX-License-Identifier: Apache-2.0
"""How table files are mapped, and that host memory stays in place when they are read or
registered: copy-on-write for the CPU, read-only shared for a GPU (``placement.maps_shared``),
every page faulted in before a read-only registration (``placement.prefault``).

Linux reports each mapping's mode and resident pages in /proc/self/smaps and the process's
anonymous pages in /proc/self/status (RssAnon): the tests read those, on real files. The GPU
registration itself runs only where CUDA does (the last test; it skips elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ibpembed import compress
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.placement import HostAliases, maps_shared
from tests.cuda import cuda_kernels_missing
from tests.tables.helpers import trained_like

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps"
)

MIB = 1 << 20


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def mappings(path: Path) -> list[tuple[str, int]]:
    """(permissions, resident bytes) of every mapping of ``path`` in this process."""
    found: list[tuple[str, int]] = []
    perms = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            perms = fields[1] if len(fields) == 6 and fields[5] == str(path) else None
        elif perms is not None and fields[0] == "Rss:":
            found.append((perms, int(fields[1]) * 1024))
    return found


@pytest.fixture(scope="module")
def table_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A table file with a payload of about 24 MiB."""
    path = tmp_path_factory.mktemp("mapping") / "t.ibpt"
    tw.write_table(path, compress(trained_like(48_000, 128)), name="t")
    return path.resolve()


def test_files_are_mapped_copy_on_write_by_default_and_shared_read_only_for_a_gpu(
    table_file: Path,
) -> None:
    private = tf.read_table(table_file)
    assert [perms for perms, _ in mappings(table_file)] == ["rw-p"]
    del private
    shared = tf.read_table(table_file, shared=True)
    assert [perms for perms, _ in mappings(table_file)] == ["r--s"]
    del shared
    assert maps_shared(torch.device("cuda")) and not maps_shared(torch.device("cpu"))


def test_reading_a_shared_mapping_adds_no_anonymous_memory(table_file: Path) -> None:
    loaded = tf.read_table(table_file, shared=True)
    payload = loaded.table.payload
    assert payload.numel() > 16 * MIB
    before = rss_anon()
    total = int(payload.sum())  # every payload byte read
    rows = loaded.table.gather(torch.arange(0, loaded.table.num_rows, 7))
    grown = rss_anon() - before
    assert total > 0 and rows.shape[0] > 0
    # The gathered rows themselves are anonymous (about 3.5 MiB); the payload's 24 MiB are not.
    assert grown < 8 * MIB, f"RssAnon grew by {grown / MIB:.1f} MiB reading a mapped table"
    assert sum(rss for _, rss in mappings(table_file)) >= payload.numel()  # file pages instead


def test_a_read_only_registration_sees_every_page_faulted_in(table_file: Path) -> None:
    loaded = tf.read_table(table_file, shared=True)
    payload = loaded.table.payload
    resident_at_register: list[int] = []

    def register(host: torch.Tensor, read_only: bool) -> torch.Tensor:
        assert read_only
        resident_at_register.append(sum(rss for _, rss in mappings(table_file)))
        return host

    before = sum(rss for _, rss in mappings(table_file))
    assert before < payload.numel()  # the load touched the index, not the payload
    aliases = HostAliases(register)
    alias, release = aliases.acquire(payload)
    assert torch.equal(alias[:4096], payload[:4096])
    assert resident_at_register == [resident_at_register[0]]
    assert resident_at_register[0] >= os.stat(table_file).st_size - 4096
    release()


@pytest.mark.skipif(cuda_kernels_missing() is not None, reason=cuda_kernels_missing() or "")
def test_a_registered_shared_mapping_adds_no_anonymous_memory(table_file: Path) -> None:
    from ibpembed._ops import ops
    from ibpembed.tables.placement import cuda_register, place_table

    loaded = tf.read_table(table_file, shared=True)
    device = torch.device("cuda")
    before = rss_anon()
    placed = place_table(loaded.table, device, HostAliases(cuda_register(device)))
    grown = rss_anon() - before
    assert grown < 8 * MIB, f"registering grew RssAnon by {grown / MIB:.1f} MiB"
    ids = torch.arange(0, loaded.table.num_rows, 5)
    got = ops.ibp_gather(*placed.op_args(), ids.to(device)).cpu()
    want = loaded.table.gather(ids).contiguous().view(torch.uint8).view(ids.numel(), -1)
    assert torch.equal(got, want)
