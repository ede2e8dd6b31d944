# SPDX-License-Identifier: Apache-2.0
"""The ``ibpembed`` command. Each area registers its own subcommands (see COMMANDS)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence

import ibpembed

DESCRIPTION = (
    "ibpembed: lossless compressed (Invariant Bit Packing) embedding tables and the gRPC service"
    " that looks them up. `ibpembed COMMAND --help` describes each command."
)
# Not a subcommand: the load generator ships with the torch-free client, which a load-test
# machine installs alone.
EPILOG = (
    "load generator: ibpembed-loadgen (installed with the client, clients/python;"
    " `ibpembed-loadgen --help`)"
)

# Each subcommand: the module whose ``register(subparsers)`` adds it (and sets
# ``func(args) -> int``), and its one-line summary. The modules import torch (over a second), so
# `ibpembed --help` and `--version` list the summaries without importing them, and a command
# imports only its own module; a test checks the summaries against what the modules register.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "ibpembed.server.cli",
        "serve lookups over gRPC (no --tables: the embedded demo table set)",
    ),
    "pack": ("ibpembed.tables.cli", "compress tables into a table set directory"),
    "inspect": ("ibpembed.tables.cli", "print table file headers and sections (no decoding)"),
    "verify": ("ibpembed.tables.cli", "check every checksum and decode every row"),
    "triton-repo": ("ibpembed.triton.cli", "write a Triton model repository serving a table set"),
    "triton-serve": (
        "ibpembed.triton.local",
        "run Triton Inference Server on a table set, locally",
    ),
}


EXIT_BROKEN_PIPE = 141


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``ibpembed`` parser: every command's full parser, or only those of ``commands`` (the
    others listed with their summaries, their modules not imported)."""
    parser = argparse.ArgumentParser(prog="ibpembed", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"ibpembed {ibpembed.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = COMMANDS if commands is None else [c for c in commands if c in COMMANDS]
    for module in dict.fromkeys(COMMANDS[c][0] for c in wanted):
        importlib.import_module(module).register(subparsers)
    for name, (_, summary) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first word that is not an option names the command (the top level has only options).
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser([command] if command else []).parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`ibpembed inspect DIR | head`): stop quietly, as `cat` does,
        # instead of a traceback. Python's own flush at exit would raise again: point stdout
        # at /dev/null first. 128 + SIGPIPE is the status a shell shows for such a writer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
