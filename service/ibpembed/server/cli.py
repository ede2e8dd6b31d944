# SPDX-License-Identifier: Apache-2.0
"""``ibpembed serve``: run the gRPC lookup server (settings: :mod:`ibpembed.server.config`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ibpembed.server import config as server_config


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="serve lookups over gRPC (no --tables: the embedded demo table set)",
        description=__doc__,
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
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported here so `ibpembed --help` does not pay for torch and grpc.
    from ibpembed.server.app import serve
    from ibpembed.server.logs import quiet_dead_call_replies

    quiet_dead_call_replies()

    try:
        return asyncio.run(serve(cfg))
    except (ValueError, OSError, RuntimeError) as exc:
        # Tables that do not load, a port in use (LookupServer.start: RuntimeError), unreadable
        # certs.
        print(f"ibpembed serve: {exc}", file=sys.stderr)
        return 1
