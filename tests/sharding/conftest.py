# SPDX-License-Identifier: Apache-2.0
"""One packed table set (whole and in 3 row shards) and the server processes serving it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ibpembed.tables.importers import TableSet
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.shards import pack_shards
from tests.sharding.helpers import SHARDS, make_table_set
from tools.serve_process import ServerProcess


@dataclass(frozen=True)
class Packed:
    table_set: TableSet
    whole: Path  # one table set with every row
    sharded: Path  # shard-<k>-of-3/ table sets and shard_map.json


@dataclass(frozen=True)
class Servers:
    whole: str  # address of the server holding everything
    shards: list[str]  # address of shard k's server
    spare: ServerProcess  # a second server of shard 1, for the test that kills it


def serve(tables: Path) -> ServerProcess:
    """One server of ``tables``, started without waiting so that all of them load at once."""
    return ServerProcess(
        "--tables", str(tables), "--workers", "1", "--torch-threads", "1", wait=False
    )


@pytest.fixture(scope="package")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    root = tmp_path_factory.mktemp("sharding")
    table_set = make_table_set()
    pack_table_set(root / "whole", table_set, sample_rows=None)
    pack_shards(root / "sharded", table_set, SHARDS, sample_rows=None)
    return Packed(table_set, root / "whole", root / "sharded")


@pytest.fixture(scope="package")
def servers(packed: Packed) -> Iterator[Servers]:
    # Started together: each child spends seconds importing torch, in parallel.
    whole = serve(packed.whole)
    shards = [serve(packed.sharded / f"shard-{k}-of-{SHARDS}") for k in range(SHARDS)]
    spare = serve(packed.sharded / f"shard-1-of-{SHARDS}")
    processes = [whole, *shards, spare]
    try:
        for process in processes:
            process.wait_listening()
        yield Servers(whole.target, [s.target for s in shards], spare)
    finally:
        for process in processes:
            process.kill()
