# SPDX-License-Identifier: Apache-2.0
"""The Dockerfile read as instructions, stage by stage: no Docker engine runs in CI, so the
tests check the images by reading it."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"

Instruction = tuple[str, str]  # (INSTRUCTION, its arguments)


def instructions() -> list[Instruction]:
    """Every instruction, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def stages() -> dict[str, list[Instruction]]:
    """Each stage's instructions, its FROM first, by its name (``FROM ... AS name``), in file
    order: the last one is what a build without ``--target`` makes."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for op, args in instructions():
        if op == "FROM":
            current = out[args.split()[-1]] = []
        if current is not None:  # the global ARGs before the first FROM belong to no stage
            current.append((op, args))
    return out
