# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the reliability campaigns: a small awkward table set, and TLS keys.

The RPC fuzz, the soak, the fault injections and the security checks all drive ``ibpembed serve``
as a separate process (:class:`tools.serve_process.ServerProcess`: a crash is a dead process, not
a test exception, and its RSS and open file descriptors can be read from ``/proc``), serving a
table set packed on disk by the same code ``ibpembed pack`` runs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.pack import pack_table_set
from tools.serve_process import ServerProcess


@dataclass(frozen=True)
class FuzzTable:
    """One table of the fuzz set: its rows as packed, and the features reading it."""

    name: str
    weight: torch.Tensor
    features: tuple[str, ...]
    quant: str | None = None


def fuzz_tables(seed: int = 0, rows: int = 1000) -> list[FuzzTable]:
    """Awkward tables: fp32 D=16 read by two features, bf16 D=8, fp16 D=3, row-wise int8, D=1."""
    gen = torch.Generator().manual_seed(seed)
    f32 = torch.randn(rows, 16, generator=gen) * 0.05
    f32[::97] = 0.0
    f32[1, 0] = float("nan")  # NaN rows travel bit-exact and pool to NaN, not to an error
    rng = np.random.default_rng(seed)
    header = np.stack([rng.uniform(1e-3, 1e-2, rows), rng.uniform(-0.5, 0, rows)], 1)
    q8 = np.concatenate(
        [header.astype(np.float16).view(np.uint8), rng.integers(0, 256, (rows, 12), np.uint8)], 1
    )
    return [
        FuzzTable("emb_f32", f32, ("user", "user_hist")),
        FuzzTable(
            "emb_bf16", (torch.randn(rows // 2, 8, generator=gen) * 0.05).bfloat16(), ("item",)
        ),
        FuzzTable("emb_f16", (torch.randn(rows // 3, 3, generator=gen) * 0.05).half(), ("ctx",)),
        FuzzTable("emb_q8", torch.from_numpy(q8.copy()), ("quant",), "int8_rowwise"),
        FuzzTable("emb_d1", torch.randn(7, 1, generator=gen), ("tiny",)),
    ]


def pack_fuzz_set(directory: Path, tables: Sequence[FuzzTable]) -> None:
    """Pack ``tables`` as a table set in ``directory`` (what ``ibpembed pack`` writes)."""
    sources = tuple(
        TableSource(t.name, t.weight.contiguous(), quant=t.quant, feature_names=t.features)
        for t in tables
    )
    pack_table_set(directory, TableSet(sources))


def settle(server: ServerProcess, seconds: float = 0.5) -> tuple[int, int]:
    """(RSS, fds) of an idle server after a short pause (closed sockets take a moment to go)."""
    time.sleep(seconds)
    return server.rss(), server.fds()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=120)


def make_pki(directory: Path) -> Path:
    """Two CAs (``ca``, ``rogue``), a ``server`` cert for 127.0.0.1 and a ``client`` cert, by ca.

    Files: ``<name>.crt`` and ``<name>.key`` in ``directory`` (needs the openssl CLI).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "rogue"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-subj",
            f"/CN={ca}",
            "-days",
            "2",
            "-out",
            f"{ca}.crt",
            cwd=directory,
        )
    leaves = {
        "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in leaves.items():
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-subj",
            f"/CN={name}",
            "-out",
            f"{name}.csr",
            cwd=directory,
        )
        (directory / f"{name}.ext").write_text(ext)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.crt",
            cwd=directory,
        )
    return directory
