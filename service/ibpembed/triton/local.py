# SPDX-License-Identifier: Apache-2.0
"""``ibpembed triton-serve``: Triton Inference Server on a table set, on this machine.

One command for what otherwise takes five steps: write the model repository (``triton-repo``),
find a ``tritonserver`` (the one on PATH, as in NVIDIA's image, else the binary inside the
``nvidia-pytriton`` wheel, requirements/triton.txt), give that wheel's Python backend the stub
built for this interpreter's Python (the wheel keeps its stubs apart: a backend directory of
links is assembled in a temporary directory, nothing installed is modified), put this venv's
``bin`` first on PATH and the directories ibpembed, its client and its dependencies are
imported from on PYTHONPATH (the backend's stub does not apply it; the model's model.py does),
then run the server in the foreground until SIGINT or SIGTERM.

Exit codes: tritonserver's own; 1 when no tritonserver or stub is found or the repository cannot
be written; 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from ibpembed.tables.manifest import TableSetError
from ibpembed.triton.repo import POOLINGS, RepositoryError, write_repository


def tritonserver_root() -> Path | None:
    """The ``tritonserver`` directory of the installed nvidia-pytriton wheel, if any."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(spec.submodule_search_locations[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def python_backend_dir(root: Path, into: Path) -> Path:
    """A backends directory whose ``python/`` holds the wheel's backend and this Python's stub."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"the nvidia-pytriton wheel has no Python backend stub for {version}")
    python = into / "backends" / "python"
    python.mkdir(parents=True)
    for item in (root / "backends" / "python").iterdir():
        if item.name != "__pycache__":
            (python / item.name).symlink_to(item)
    (python / stub.name).symlink_to(stub)
    return into / "backends"


def model_python_path() -> str:
    """PYTHONPATH for the model: where ibpembed and its client are imported from, then this
    interpreter's site-packages (torch, numpy), so a source checkout works as an install does."""
    entries = []
    for package in ("ibpembed", "ibpembed_client"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            entries.append(str(Path(spec.submodule_search_locations[0]).parent))
    entries.append(sysconfig.get_paths()["purelib"])
    return os.pathsep.join(dict.fromkeys(entries))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the triton-serve subcommand to the ``ibpembed`` parser."""
    cmd = subparsers.add_parser(
        "triton-serve",
        help="run Triton Inference Server on a table set, locally",
        description="Write a Triton model repository for the table set TABLES (as triton-repo "
        "does) and run tritonserver on it in the foreground, with the Python backend set up for "
        "this interpreter: the tritonserver on PATH, else the one in the nvidia-pytriton wheel "
        "(pip install --no-deps -r requirements/triton.txt).",
    )
    cmd.add_argument("tables", type=Path, metavar="TABLES", help="a packed table set directory")
    cmd.add_argument(
        "--repository",
        type=Path,
        default=None,
        metavar="REPO",
        help="model repository to add the table set to (as a new model version) and serve "
        "(default: a temporary one, removed at exit)",
    )
    cmd.add_argument("--pooling", choices=POOLINGS, default="sum", help="default: sum")
    cmd.add_argument("--device", default="cpu", help="engine device: cpu or cuda[:k]")
    cmd.add_argument(
        "--host", default="127.0.0.1", help="HTTP and gRPC address (default: %(default)s)"
    )
    cmd.add_argument("--http-port", type=int, default=8000, help="default: %(default)s")
    cmd.add_argument("--grpc-port", type=int, default=8001, help="default: %(default)s")
    cmd.add_argument("--metrics-port", type=int, default=8002, help="default: %(default)s")
    cmd.set_defaults(func=run)


def _serve(args: argparse.Namespace, repository: Path, scratch: Path) -> int:
    on_path = shutil.which("tritonserver")
    root = tritonserver_root()
    if on_path is not None:
        binary, backends = on_path, []  # NVIDIA's image: its own backends directory and stubs
    elif root is not None:
        binary = str(root / "bin" / "tritonserver")
        backends = [f"--backend-directory={python_backend_dir(root, scratch)}"]
    else:
        print(
            "ibpembed triton-serve: error: no tritonserver on PATH and nvidia-pytriton is not"
            " installed (pip install --no-deps -r requirements/triton.txt)",
            file=sys.stderr,
        )
        return 1
    argv = [
        binary,
        f"--model-repository={repository}",
        *backends,
        f"--http-address={args.host}",
        f"--http-port={args.http_port}",
        f"--grpc-address={args.host}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-port={args.metrics_port}",
        "--allow-gpu-metrics=false",
    ]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": model_python_path(),
    }
    print(f"starting {' '.join(argv)}", flush=True)
    print(
        f"infer: curl -X POST http://{args.host}:{args.http_port}/v2/models/ibpembed/infer -d ...",
        flush=True,
    )
    proc = subprocess.Popen(argv, env=env)
    # tritonserver unloads its models on SIGTERM or SIGINT; pass ours on and wait for it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    return proc.wait()


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ibpembed-triton-") as tmp:
        scratch = Path(tmp)
        repository = args.repository or scratch / "repository"
        try:
            write_repository(args.tables, repository, pooling=args.pooling, device=args.device)
            return _serve(args, repository, scratch)
        except (RepositoryError, TableSetError, RuntimeError) as exc:
            print(f"ibpembed triton-serve: error: {exc}", file=sys.stderr)
            return 1
