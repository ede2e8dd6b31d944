# SPDX-License-Identifier: Apache-2.0
"""``ibpembed serve``: run the gRPC lookup server (settings: ``ibpembed.server.config``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

from ibpembed.server import config as server_config

DESCRIPTION = (
    "Run the gRPC lookup server. Without --tables it serves an embedded demo table set. Each"
    " setting is a flag, an environment variable or a key of the --config TOML file (in that"
    " order of precedence); each flag below names its variable and default."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="serve lookups over gRPC (no --tables: the embedded demo table set)",
        description=DESCRIPTION,
    )
    server_config.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the config from flags, environment and file, then serve until SIGTERM."""
    try:
        cfg = server_config.load(args)
    except (ValueError, OSError) as exc:
        print(f"ibpembed serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    from ibpembed.server.logs import configure, quiet_dead_call_replies

    configure(cfg.log_level, cfg.log_format)
    # Imported here so `ibpembed --help` does not pay for torch and grpc.
    from ibpembed.server.app import LOAD_THREAD, serve

    quiet_dead_call_replies()

    try:
        code = asyncio.run(serve(cfg))
    except (ValueError, OSError, RuntimeError) as exc:
        # Tables that do not load, a port in use (LookupServer.start: RuntimeError), unreadable
        # certs, a failed CUDA self-test with --device cuda.
        print(f"ibpembed serve: {exc}", file=sys.stderr)
        return 1
    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped while the tables load: the abandoned load thread is inside torch's C++, and
        # interpreter shutdown under it aborts the process (SIGABRT, "terminate called without
        # an active exception"). Nothing was served and nothing needs cleaning up.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
