# SPDX-License-Identifier: Apache-2.0
"""``ibpembed serve``: run the gRPC lookup server (settings: :mod:`ibpembed.server.config`)."""

from __future__ import annotations

import argparse
import asyncio
import logging

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
    cfg = server_config.load(args)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported here so `ibpembed --help` does not pay for torch and grpc.
    from ibpembed.server.app import serve

    return asyncio.run(serve(cfg))
