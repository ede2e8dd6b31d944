# SPDX-License-Identifier: Apache-2.0
"""Generate the Python gRPC stubs for proto/ibpembed/v1/*.proto into the client package.

    python proto/generate.py                 # writes clients/python/ibpembed_client/v1/
    python proto/generate.py --out DIR       # writes DIR/ibpembed_client/v1/ (freshness test)

The proto directory ``proto/ibpembed`` is mounted at the import path ``ibpembed_client`` (protoc's
``VIRTUAL=DISK`` proto path), so the generated modules import each other as
``ibpembed_client.v1.*`` and no import needs rewriting. The server imports these same files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent / "ibpembed"
CLIENT_ROOT = PROTO_ROOT.parent.parent / "clients" / "python"


def generate(out: Path) -> list[Path]:
    """Run protoc on every ``.proto`` under ``proto/ibpembed``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(PROTO_ROOT.rglob("*.proto"))
    virtual = [f"ibpembed_client/{p.relative_to(PROTO_ROOT).as_posix()}" for p in sources]
    args = [
        "protoc",
        f"--proto_path=ibpembed_client={PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *virtual,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out / "ibpembed_client").rglob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CLIENT_ROOT, help="output root")
    for path in generate(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
