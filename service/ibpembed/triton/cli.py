# SPDX-License-Identifier: Apache-2.0
"""``ibpembed triton-repo``: a Triton model repository serving a packed table set.

Exit codes: 0 success; 1 a table set or repository that does not fit; 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ibpembed.tables.manifest import TableSetError
from ibpembed.triton.repo import (
    POOLINGS,
    RepositoryError,
    check_model_name,
    write_repository,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the triton-repo subcommand to the ``ibpembed`` parser."""
    cmd = subparsers.add_parser(
        "triton-repo",
        help="write a Triton model repository serving a table set",
        description="Write (or add a version to) a Triton Python-backend model serving the "
        "packed table set TABLES: REPO/NAME/config.pbtxt and REPO/NAME/VERSION/model.py. Per "
        "feature f the model takes f__ids (INT64), f__lengths (INT32) and optional f__weights "
        "(FP32), and answers f__pooled (FP32 [B, D]) or, with --pooling none, f__rows.",
    )
    cmd.add_argument("tables", type=Path, metavar="TABLES", help="a packed table set directory")
    cmd.add_argument("-o", "--output", required=True, type=Path, metavar="REPO")
    cmd.add_argument(
        "--name", default="ibpembed", type=_model_name, help="model name (default: ibpembed)"
    )
    cmd.add_argument(
        "--version",
        type=int,
        default=None,
        help="model version for this table set (default: one past the highest present)",
    )
    cmd.add_argument("--pooling", choices=POOLINGS, default="sum", help="default: sum")
    cmd.add_argument("--device", default="cpu", help="engine device: cpu or cuda[:k]")
    cmd.add_argument("--instances", type=int, default=1, help="model instances (default: 1)")
    cmd.add_argument(
        "--feature",
        action="append",
        dest="features",
        metavar="NAME",
        help="serve only this feature (repeatable; default: every feature the pooling serves)",
    )
    cmd.set_defaults(func=run)


def _model_name(text: str) -> str:
    """``--name``'s value; one that is not a directory name is a usage error (exit 2)."""
    try:
        return check_model_name(text)
    except RepositoryError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    try:
        version_dir = write_repository(
            args.tables,
            args.output,
            name=args.name,
            version=args.version,
            pooling=args.pooling,
            device=args.device,
            instances=args.instances,
            features=args.features,
        )
    except (RepositoryError, TableSetError) as exc:
        print(f"ibpembed triton-repo: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {version_dir} (model '{args.name}', version {version_dir.name})")
    print(
        f"run: tritonserver --model-repository={args.output} (ibpembed importable by the "
        "Python backend: see deploy/triton/README.md)"
    )
    return 0
