# SPDX-License-Identifier: Apache-2.0
"""``ibpembed pack | inspect | verify``: build, look into and check table files.

This module only parses the flags; the commands are :mod:`ibpembed.tables.commands`, imported
when one runs: they import torch (over a second), which ``ibpembed pack --help`` does without.

Exit codes: 0 success; 1 a fault in the data (bad source, corrupt or mismatched file);
2 bad command-line usage (argparse).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ibpembed import codec_options

if TYPE_CHECKING:
    from ibpembed.tables.tier_budget import TierBudget


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the pack, inspect and verify subcommands to the ``ibpembed`` parser."""
    pack = subparsers.add_parser(
        "pack",
        help="compress tables into a table set directory",
        description="Compress embedding tables (.pt/.pth state dicts or tensors, .safetensors, "
        ".npy, or directories of them) into DIR: one .ibpt file per table and manifest.json. "
        "Each pack publishes the next table-set version of DIR (servers keep the last few and "
        "serve them on request).",
    )
    pack.add_argument(
        "sources",
        nargs="+",
        metavar="SRC",
        type=Path,
        help="checkpoint, tensor, .safetensors or .npy file, or a directory of them",
    )
    pack.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        metavar="DIR",
        help="table-set directory to publish into (created if missing)",
    )
    pack.add_argument(
        "--method",
        choices=("ibpembed", "paper", "raw"),
        default="ibpembed",
        help="ibpembed: per-position masks, chunk and code width measured per table (default); "
        "paper: the published global-threshold sweep on the widest integer view; raw: every "
        "row stored raw (the uncompressed baseline, in the same layout and engine)",
    )
    pack.add_argument(
        "--align",
        type=_align,
        default=codec_options.DEFAULT_ALIGN,
        help="slot alignment in bytes (default: the unit that stores the table smallest)",
    )
    pack.add_argument(
        "--chunk-bits",
        type=int,
        choices=codec_options.CHUNK_BITS_CHOICES,
        default=None,
        help="force the chunk width (default: measured per table)",
    )
    pack.add_argument(
        "--code-bits",
        type=int,
        choices=codec_options.CODE_BITS_CHOICES,
        default=None,
        help="force the code width: 1 = plain IBP (fastest decode), 2-4 = exponent-aware "
        "codebooks (default: measured per table)",
    )
    pack.add_argument(
        "--sample-rows",
        type=_at_least(0),
        default=codec_options.DEFAULT_SAMPLE_ROWS,
        help="rows sampled to fit the masks; 0 = all rows",
    )
    pack.add_argument(
        "--seed", type=int, default=0, help="seed of the random row sample the fit measures on"
    )
    pack.add_argument(
        "--table",
        action="append",
        default=None,
        metavar="NAME",
        help="pack only this table (repeatable)",
    )
    pack.add_argument(
        "--feature",
        action="append",
        type=_feature_pair,
        default=[],
        metavar="FEATURE=TABLE",
        help="also serve FEATURE from TABLE (repeatable)",
    )
    pack.add_argument(
        "--shards",
        type=_at_least(1),
        default=None,
        metavar="N",
        help="split every table into N contiguous row ranges: DIR/shard-<k>-of-<N>/ table sets "
        "and DIR/shard_map.json (one server per shard)",
    )
    pack.add_argument(
        "--shard-address",
        default=None,
        metavar="TEMPLATE",
        help="shard addresses for shard_map.json, {shard} standing for k "
        "(e.g. ibpembed-{shard}.ibpembed:50051); needs --shards",
    )
    pack.add_argument(
        "--merge",
        action="store_true",
        help="keep the other tables already in DIR (and their features) and add or replace only "
        "these; without it DIR's new manifest lists only the packed tables (a running server "
        "reloads it and drops the rest)",
    )
    pack.add_argument(
        "--for-gpu",
        action="store_true",
        help="lay tables out for a GPU's zero-copy reads: slots on 32-byte boundaries where that "
        "saves PCIe lines, raw rows where compression would cost sectors (inspect says which)",
    )
    pack.add_argument("--no-progress", action="store_true", help="no progress bar")
    pack.add_argument("--json", action="store_true", help="print the report as JSON")
    pack.set_defaults(func=_pack)

    inspect = subparsers.add_parser(
        "inspect",
        help="print table file headers and sections (no decoding)",
        description="Print the header, section table and metadata of an .ibpt file, or the "
        "manifest and headers of a table set directory, without decoding any row.",
    )
    inspect.add_argument(
        "path", type=Path, metavar="FILE|DIR", help="a table file (.ibpt) or a table set directory"
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (manifest, every file's header, sections and meta, and the "
        "size summary) instead of text",
    )
    inspect.add_argument(
        "--hot-tier",
        metavar="BUDGET",
        type=_tier_budget,
        help="also price a decoded hot tier (serve's --hot-tier: 5%%, savings, 512MiB, all): "
        "its bytes per table and the savings left net of it",
    )
    inspect.set_defaults(func=_inspect)

    verify = subparsers.add_parser(
        "verify",
        help="check every checksum and decode every row",
        description="Check every section checksum, decode every row and compare with the source "
        "hash recorded at pack time. Exit code 1 on any fault.",
    )
    verify.add_argument(
        "path", type=Path, metavar="FILE|DIR", help="a table file (.ibpt) or a table set directory"
    )
    verify.add_argument(
        "--json",
        action="store_true",
        help="print one JSON report (every table's result) instead of a line per table",
    )
    verify.set_defaults(func=_verify)


# The commands, each imported as it runs (see the module docstring).


def _pack(args: argparse.Namespace) -> int:
    from ibpembed.tables import commands

    return commands.run_pack(args)


def _inspect(args: argparse.Namespace) -> int:
    from ibpembed.tables import commands

    return commands.run_inspect(args)


def _verify(args: argparse.Namespace) -> int:
    from ibpembed.tables import commands

    return commands.run_verify(args)


# The flags' own checks are argparse types, so a bad value is a usage error (exit 2) before
# any source is read.


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _align(text: str) -> int:
    value = _int(text)
    if value < 1 or value & (value - 1) or value > codec_options.MAX_SLOT_UNIT:
        raise argparse.ArgumentTypeError(
            f"must be a power of two <= {codec_options.MAX_SLOT_UNIT}, got {value}"
        )
    return value


def _feature_pair(text: str) -> tuple[str, str]:
    feature, sep, table = text.partition("=")
    if not sep or not feature or not table:
        raise argparse.ArgumentTypeError(f"expected FEATURE=TABLE, got {text!r}")
    return feature, table


def _tier_budget(text: str) -> TierBudget:
    """``--hot-tier``'s value; a malformed one is a usage error (exit 2)."""
    from ibpembed.tables.tier_budget import TierBudget

    try:
        return TierBudget.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
