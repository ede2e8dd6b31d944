# SPDX-License-Identifier: Apache-2.0
"""Table placement for a device, without a GPU: which tensor goes where, one registration per
host buffer, and snapshots that own their device copies across updates and reloads.

The target device is a parameter of the store and of ``place_table``, so these tests place onto
the ``meta`` device: it checks devices and shapes, not values (the CUDA cases in
tests/cuda/test_cuda_ops.py read values on a GPU). ``cudaHostRegister`` cannot run here; the
registrations are made by a ``Register`` that aliases the host buffer itself (values check) or
returns its meta image (placement checks), and counts its calls.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
import torch

from ibpembed import compress
from ibpembed.engine import LookupEngine
from ibpembed.tables.placement import HostAliases, place_table
from ibpembed.tables.store import TableStore
from tests.tables.helpers import trained_like
from tests.tables.test_store import pack

META = torch.device("meta")
SMALL = ("block_base", "row_units", "bitmask", "mask", "bitval")


class CountingRegister:
    """Registers by aliasing the host storage (``to`` = None) or by imaging it on ``to``."""

    def __init__(self, to: torch.device | None = None, fail: bool = False) -> None:
        self.to = to
        self.fail = fail
        self.calls: list[tuple[int, int, bool]] = []  # (storage address, bytes, read_only)

    def __call__(self, host: torch.Tensor, read_only: bool) -> torch.Tensor:
        assert host.storage_offset() == 0
        assert host.numel() == host.untyped_storage().nbytes()  # always the whole buffer
        if self.fail:
            raise RuntimeError("cudaHostRegister failed: operation not permitted")
        self.calls.append((host.data_ptr(), host.numel(), read_only))
        return host if self.to is None else host.to(self.to)


def test_cpu_placement_is_the_table_itself() -> None:
    table = compress(trained_like(100, 8))
    assert place_table(table, torch.device("cpu")) is table


def test_device_placement_copies_the_small_tensors_and_aliases_the_payload() -> None:
    table = compress(trained_like(300, 8)).with_hot_rows(torch.arange(10))
    register = CountingRegister(META)
    placed = place_table(table, META, HostAliases(register))
    for name in SMALL:
        host, dev = getattr(table, name), getattr(placed, name)
        assert dev.device == META and dev.shape == host.shape and dev.dtype == host.dtype
    assert placed.payload.device == META and placed.payload.shape == table.payload.shape
    assert placed.hot is None  # the CUDA kernels read no decoded tier
    assert table.hot is not None and table.block_base.device.type == "cpu"  # host untouched
    assert register.calls == [
        (table.payload.data_ptr(), table.payload.untyped_storage().nbytes(), True)
    ]
    # Same ints, so the engine's checks read the placed table as they read the host one.
    assert (placed.num_rows, placed.dim, placed.dtype) == (table.num_rows, table.dim, table.dtype)


def test_a_payload_on_the_device_stays_there() -> None:
    table = compress(trained_like(100, 8))
    on_device = place_table(table, META, HostAliases(CountingRegister(META)))
    register = CountingRegister(META)
    again = place_table(on_device, META, HostAliases(register))
    assert again.payload is on_device.payload and register.calls == []
    assert again.block_base is not on_device.block_base  # a snapshot owns its copies


def test_one_registration_per_buffer_and_views_at_their_offsets() -> None:
    buffer = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    first, second = buffer[:1024], buffer[2048:3072]
    register = CountingRegister()
    aliases = HostAliases(register, read_only=False)
    alias_a, release_a = aliases.acquire(first)
    alias_b, release_b = aliases.acquire(second)
    assert len(register.calls) == 1 and register.calls[0][1:] == (4096, False)
    assert alias_a.data_ptr() == first.data_ptr() and torch.equal(alias_a, first)
    assert alias_b.data_ptr() == second.data_ptr() and torch.equal(alias_b, second)
    assert aliases.holds(second) and not aliases.holds(torch.zeros(4, dtype=torch.uint8))
    release_a()
    assert len(aliases) == 1  # the second view still holds the buffer
    release_b()
    assert len(aliases) == 0
    aliases.acquire(first)
    assert len(register.calls) == 2  # registered afresh once every holder let go


def test_aliases_are_given_back_when_the_placed_table_goes() -> None:
    aliases = HostAliases(CountingRegister(META))
    placed = place_table(compress(trained_like(100, 8)), META, aliases)
    assert len(aliases) == 1
    del placed
    gc.collect()
    assert len(aliases) == 0


def test_a_failed_registration_keeps_the_payload_on_the_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = compress(trained_like(100, 8))
    aliases = HostAliases(CountingRegister(META, fail=True))
    with caplog.at_level(logging.WARNING, logger="ibpembed.tables.placement"):
        placed = place_table(table, META, aliases)
    assert "registering a" in caplog.text and "operation not permitted" in caplog.text
    assert placed.payload is table.payload and len(aliases) == 0
    assert placed.block_base.device == META


def test_aliases_reject_what_cannot_be_registered() -> None:
    aliases = HostAliases(CountingRegister())
    with pytest.raises(ValueError, match="1-D uint8 CPU"):
        aliases.acquire(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        aliases.acquire(torch.zeros(8, dtype=torch.uint8)[::2])


def placed_store(directory: Path) -> tuple[TableStore, CountingRegister]:
    register = CountingRegister(META)
    return TableStore.load(directory, device=META, aliases=HostAliases(register)), register


def test_every_table_of_a_snapshot_is_placed(table_dir: Path) -> None:
    store, register = placed_store(table_dir)
    with store.acquire() as snap:
        for name, table in snap.tables.items():
            kernel = snap.kernel_table(name)
            assert table.block_base.device.type == "cpu"  # what save and updates read
            assert all(getattr(kernel, t).device == META for t in SMALL)
            assert kernel.payload.device == META
    assert len(register.calls) == 2  # one mapped file per table


def test_a_row_update_publishes_fresh_copies_of_the_table_it_changed(table_dir: Path) -> None:
    store, register = placed_store(table_dir)
    with store.acquire() as snap:
        before = {n: snap.kernel_table(n) for n in snap.tables}
    store.update_rows("user", torch.tensor([3]), torch.zeros(1, 8))
    store.update_rows("user", torch.tensor([40]), torch.ones(1, 8))
    with store.acquire() as snap:
        user, item = snap.kernel_table("user"), snap.kernel_table("item")
        host = snap.tables["user"]
    assert item is before["item"]  # unchanged: its copies are kept
    assert user is not before["user"]
    for name in SMALL:
        assert getattr(user, name).shape == getattr(host, name).shape
        assert getattr(user, name).device == META
    assert user.payload.shape == host.payload.shape
    # The first update compacted the mapped table into a spill buffer; the second appended to
    # it: one new registration for both.
    assert len(register.calls) == 3
    assert register.calls[2][0] == host.payload.data_ptr()


def test_a_reload_places_the_tables_it_changed(table_dir: Path) -> None:
    store, register = placed_store(table_dir)
    with store.acquire() as snap:
        old = snap.kernel_table("user")
    assert store.reload() is False
    with store.acquire() as snap:
        assert snap.kernel_table("user") is old
    pack(table_dir, 2)
    assert store.reload() is True
    with store.acquire() as snap:
        assert snap.kernel_table("user") is not old
        assert snap.kernel_table("user").block_base.device == META
    assert len(register.calls) == 4


def test_an_engine_refuses_a_store_placed_for_another_device(table_dir: Path) -> None:
    store, _ = placed_store(table_dir)
    with pytest.raises(ValueError, match="places its tables for meta"):
        LookupEngine(store, device="cpu")
    cpu = TableStore.load(table_dir)
    engine = LookupEngine(cpu, device="auto")  # "auto" follows a CPU store
    assert engine.device.type == "cpu"
    engine.close()


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "set"
    pack(directory, 1)
    return directory
