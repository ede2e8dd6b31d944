# SPDX-License-Identifier: Apache-2.0
"""Phase ``build``: ibpembed._C from source with its CUDA kernels, on the device's own torch
(``setup.py build_ext --inplace``, only the device's sm_XY unless IBPEMBED_CUDA_ARCHS says
otherwise; ``cpp_extension.load`` when setuptools is too old or setup.py fails) and, in
parallel, the plain UVA gather baseline (benchmarks/cuda; a failure there only drops its
timings). Outputs go to benchmarks/.cache, which a second run reuses.

``--dry-run`` runs the same plan up to the compilers: setup.py's flags for the chosen
architecture, every source the two build routes compile, the tools they call. Compiling needs a
CUDA build of torch to link against, which a CPU machine does not have."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.common import CACHE, ROOT, log

BASELINE_DIR = CACHE / "ibpembed_bench"
EXTENSION_DIR = CACHE / "ibpembed_C"
SETUPTOOLS_FOR_PYPROJECT = (77, 0)  # pyproject.toml's `license = "Apache-2.0"`
BASELINE_SOURCES = (
    ROOT / "benchmarks" / "cuda" / "uva_gather_op.cpp",
    ROOT / "benchmarks" / "cuda" / "uva_gather.cu",
)
DRY_RUN_ARCH = "90"  # the GPU machine's (H200, sm_90), planned for when there is no GPU


@dataclass
class BuildPlan:
    """What the build runs: setup.py (when setuptools can read pyproject.toml) or straight to
    ``cpp_extension.load``, with these flags and sources."""

    archs: str
    setuptools: str
    use_setup_py: bool
    env: dict[str, str] = field(repr=False)
    gencode: list[str]
    isa_sources: dict[str, list[str]]
    load_sources: list[str]  # what load_extension() compiles besides the ISA objects
    tools: dict[str, str | None]  # nvcc, ninja, c++: where found


def setup_flags() -> dict[str, Any]:
    """setup.py's module globals (its flags; it builds only as __main__)."""
    return runpy.run_path(str(ROOT / "setup.py"))


def load_sources(isa: dict[str, list[str]]) -> list[Path]:
    csrc = ROOT / "csrc"
    sources = [*sorted(csrc.glob("codec/*.cpp")), *sorted(csrc.glob("lookup/*.cpp"))]
    sources += sorted(csrc.glob("ops/*.cpp"))  # registration, CPU impls and the CUDA impls
    sources += sorted(csrc.glob("cuda/*.cu"))
    return [p for p in sources if str(p.relative_to(ROOT)) not in isa]


def plan(archs: str) -> BuildPlan:
    """The build for CUDA architectures ``archs`` (IBPEMBED_CUDA_ARCHS form, e.g. "90"); raises
    when setup.py's flags or a source the build needs are missing."""
    import setuptools

    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4), IBPEMBED_CUDA_ARCHS=archs)
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    previous = os.environ.get("IBPEMBED_CUDA_ARCHS")
    os.environ["IBPEMBED_CUDA_ARCHS"] = archs  # what _gencode() reads
    try:
        flags = setup_flags()
        gencode = flags["_gencode"]()
        isa = flags["host_isa_sources"]()
    finally:
        if previous is None:
            del os.environ["IBPEMBED_CUDA_ARCHS"]
        else:
            os.environ["IBPEMBED_CUDA_ARCHS"] = previous
    want = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(",")]
    if gencode != want:
        raise RuntimeError(f"setup.py builds {gencode} for IBPEMBED_CUDA_ARCHS={archs}")
    sources = load_sources(isa)
    missing = [
        str(p) for p in [*sources, *(ROOT / s for s in isa), *BASELINE_SOURCES] if not p.is_file()
    ]
    if missing:
        raise RuntimeError(f"build sources missing: {missing}")
    if not any(p.suffix == ".cu" for p in sources):
        raise RuntimeError("no CUDA sources under csrc/cuda")
    return BuildPlan(
        archs=archs,
        setuptools=setuptools.__version__,
        use_setup_py=version >= SETUPTOOLS_FOR_PYPROJECT,
        env=env,
        gencode=gencode,
        isa_sources=isa,
        load_sources=[str(p.relative_to(ROOT)) for p in sources],
        tools={tool: shutil.which(tool) for tool in ("nvcc", "ninja", "c++")},
    )


def load_baseline() -> str | None:
    """Loads the plain UVA gather baseline (torch.ops.ibpembed_bench, built once into
    BASELINE_DIR and reused); returns why it failed, or None."""
    from torch.utils.cpp_extension import load

    BASELINE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name="ibpembed_bench",
            sources=[str(p) for p in BASELINE_SOURCES],
            extra_cflags=["-O2"],
            extra_cuda_cflags=["-O3"],
            is_python_module=False,
            build_directory=str(BASELINE_DIR),
        )
    except Exception as exc:  # a compile error must not cost the run: timings skip uva
        return repr(exc)[-2000:]
    return None


def phase_build(gpu: bool) -> dict[str, Any]:
    """Builds ibpembed._C (CUDA included) in place and the UVA baseline, in parallel; falls back
    to ``cpp_extension.load`` (``fallback``: the other phases then load it too) when setup.py
    cannot run. Without a GPU: the plan only (``stopped_before``)."""
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        archs = os.environ.get("IBPEMBED_CUDA_ARCHS", f"{major}{minor}")
    else:
        archs = os.environ.get("IBPEMBED_CUDA_ARCHS", DRY_RUN_ARCH)
    p = plan(archs)
    info: dict[str, Any] = {
        "setuptools": p.setuptools,
        "cuda_archs": p.archs,
        "route": "setup.py" if p.use_setup_py else "cpp_extension.load",
        "sources": len(p.load_sources) + len(p.isa_sources),
        "tools": p.tools,
    }
    log(f"build: setuptools {p.setuptools}, torch {torch.__version__}, sm_{p.archs}")
    if not gpu:
        info["stopped_before"] = "compiling: linking needs a CUDA build of torch"
        return info
    start = time.perf_counter()
    rc = None
    with tempfile.TemporaryFile("w+") as out:
        proc = None
        if p.use_setup_py:
            proc = subprocess.Popen(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=ROOT,
                env=p.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        info["baseline_error"] = load_baseline()
        info["baseline_s"] = round(time.perf_counter() - start, 1)
        if proc is not None:
            rc = proc.wait()
            if rc != 0:
                out.seek(0)
                log(out.read()[-8000:])
    if rc == 0:
        info["ibpembed_s"] = round(time.perf_counter() - start, 1)
        log(f"build: ibpembed._C {info['ibpembed_s']} s, UVA baseline {info['baseline_s']} s")
        return info
    log(f"build: setup.py build_ext did not build (exit {rc}); cpp_extension.load instead")
    start = time.perf_counter()
    load_extension()
    info |= {"ibpembed_s": round(time.perf_counter() - start, 1), "fallback": True}
    log(f"build: ibpembed._C via load() {info['ibpembed_s']} s")
    return info


def load_extension():
    """ibpembed._C built by cpp_extension.load, for when setup.py cannot run (e.g. a setuptools
    too old for pyproject.toml). As setup.py does, the ISA-specific files are compiled to objects
    with their own flags first (load() has no per-file flags) and linked in."""
    from torch.utils import cpp_extension

    flags = setup_flags()
    csrc = ROOT / "csrc"
    build_dir = EXTENSION_DIR
    build_dir.mkdir(parents=True, exist_ok=True)
    isa = flags["host_isa_sources"]()
    objects = []
    for source, isa_flags in isa.items():
        obj = build_dir / f"{Path(source).stem}.o"
        compile_cmd = ["c++", *flags["CXX_FLAGS"], "-fPIC", f"-I{csrc / 'include'}", *isa_flags]
        subprocess.run([*compile_cmd, "-c", str(ROOT / source), "-o", str(obj)], check=True)
        objects.append(str(obj))
    module = cpp_extension.load(
        name="_C",
        sources=[str(p) for p in load_sources(isa)],
        extra_include_paths=[str(csrc / "include")],
        extra_cflags=[*flags["CXX_FLAGS"], *flags["OPENMP_FLAGS"], "-DIBPEMBED_WITH_CUDA=1"],
        extra_cuda_cflags=[
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-DIBPEMBED_WITH_CUDA=1",
            *flags["_gencode"](),
        ],
        extra_ldflags=objects,
        build_directory=str(build_dir),
    )
    sys.modules["ibpembed._C"] = module  # what `import ibpembed` then finds
    return module
