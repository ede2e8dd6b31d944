# SPDX-License-Identifier: Apache-2.0
"""The ``ibpembed`` command. Each area registers its own subcommands (see COMMAND_MODULES)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import ibpembed

DESCRIPTION = (
    "ibpembed: lossless compressed (Invariant Bit Packing) embedding tables and the gRPC service"
    " that looks them up. `ibpembed COMMAND --help` describes each command."
)

# Modules exposing ``register(subparsers)``; each subcommand sets ``func(args) -> int``.
COMMAND_MODULES: tuple[str, ...] = (
    "ibpembed.server.cli",
    "ibpembed.tables.cli",
    "ibpembed.triton.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ibpembed", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ibpembed {ibpembed.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
