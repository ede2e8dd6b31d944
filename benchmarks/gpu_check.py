# SPDX-License-Identifier: Apache-2.0
"""Validate and time the CUDA path on a GPU machine, in one run that cannot waste it.

    python3 -m benchmarks.gpu_check [--out PATH] [--deadline-s 480] [--only PHASES]
                                    [--skip-build] [--table-gib 8] [--dry-run]

Each phase runs in a child process of its own and writes its JSON as it ends; the driver merges
them into one report (``--out``, default ``$OUT/gpu_check.json``) rewritten after every phase, so
a CUDA fault (which kills a process's CUDA context), an OOM or the machine's time limit costs
one phase, never what was measured before it. No phase starts past ``--deadline-s``, and a
running one is killed there. Phases, in order:

1. build: ibpembed._C from source with its CUDA kernels (``setup.py build_ext --inplace``, only
   the device's own sm_XY unless IBPEMBED_CUDA_ARCHS says otherwise; ``cpp_extension.load`` when
   setuptools is too old or setup.py fails) and, in parallel, the plain UVA gather baseline
   (benchmarks/cuda; a failure there only drops its timings). Outputs go to benchmarks/.cache,
   which a second run reuses (``--skip-build`` skips the phase).
2. preflight: a small buffer registered in place (``cudaHostRegister``, read-only where the
   device supports it) and read back zero-copy. Where registration fails, every later phase
   uses page-locked copies instead (``--pin copy``).
3. correctness, CUDA against the CPU ops on the same tables: gather and decompress bit for bit for
   every dtype (fp32/fp16/bf16/uint8/int8, fbgemm row-wise int8), edge rows (NaN payloads, inf,
   -0.0, subnormals, raw rows, D = 1, D = 129), every chunk width and slot alignment, unsorted and
   duplicate ids, the payload registered in place (as the server places it), pinned and on the
   GPU; pooled SUM/MEAN with and without weights equal to the CPU bit for bit (NaN payloads
   aside); bad ids and offsets raise like the CPU ops. On a failure or a fault the phase runs
   again with synchronous staging, to tell a cp.async problem apart.
4. served: a packed table set through ``TableStore(device="cuda")`` and ``LookupEngine`` against
   the CPU engine, before and after a row update; the host memory placing it cost.
5. sanitizer: compute-sanitizer memcheck, racecheck and synccheck over four tiny correctness
   cases (memcheck with both staging modes).
6. h2d: the pinned host-to-device copy bandwidth, the ceiling.
7. timing, one child per row size (512 first: the raw-vs-H2D target is defined there; then 64,
   1024, 256), >= --table-gib GiB of tables registered in place (DLRM value profile), batches of
   1k..64k ids, uniform and Zipf ids:
     ibp_none  compressed zero-copy gather (torch.ops.ibpembed.ibp_gather, the default sort rule)
     ibp_none_sync  the same with IBPEMBED_CUDA_STAGING=sync: does cp.async staging pay?
     ibp_none_sorted / ibp_none_nosort  ids always / never sorted: the sort rule's A/B
     ibp_sum   compressed pooled lookup, SUM over bags of 16 ids (lookup_pooled)
     ibp_sum_deferred  the same with errors deferred, as the engine runs it (no sync per call)
     raw_none / raw_sum  the same kernels on the same rows stored raw (bitmask all clear)
     uva       plain UVA gather: warp per row, 16-byte loads, no staging (benchmarks/cuda)
     cpu_h2d   CPU index_select into a pinned buffer + one cudaMemcpy (ids already on the host)
   then R = 512 again with THP_MEM_ALLOC_ENABLE=1 (2 MB pages under the tables: the huge-page
   A/B). The report has the GB/s table, the issue's targets (reported, never asserted) and
   ``sort_rule`` (where sorting paid).

--dry-run runs the same driver and children on the CPU at toy sizes: table construction and
tiling (checked against the CPU decoder), id streams, the CPU baseline, the served path on a CPU
store, the report. With no GPU to compare, the correctness checks compare the CPU ops with
independent answers instead: gathers with the source rows (bit for bit), pooled lookups with
``ibpembed.reference.lookup_pooled`` within ``reference.pooled_tolerance``. Needs only torch,
numpy and this repository (no torchrec/fbgemm, nothing downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import mmap
import os
import platform
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
ROW_BYTES = (64, 256, 512, 1024)
BATCHES = (1024, 4096, 16384, 65536)
BAG_SIZE = 16  # ids per bag in the pooled timings
TILE_BYTES = 64 << 20  # big tables are copies of one compressed tile of this many raw bytes
FIT_SAMPLE_ROWS = 65536
EDGE_BITS = {
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF, 0x7F800001,
        0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F800000],
    2: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFDFF, 0x0001, 0x83FF, 0x7BFF, 0x7F80, 0xFF81],
    1: [0x00, 0x80, 0xFF, 0x7F, 0x01],
}  # fmt: skip
POOLING = {"sum": 0, "mean": 1}
STAGING_ENV = "IBPEMBED_CUDA_STAGING"
# A GPU reads zero-copy host memory in 32-byte sectors: the wire cost of a slot is the sectors
# it touches, not its bytes (docs/cuda.md, *What compression saves on the wire*).
SECTOR_BYTES = 32
POOLED_1K_CALL_S = 20e-6  # the fixed-cost target for a pooled call of 1k ids


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Build


CACHE = ROOT / "benchmarks" / ".cache"  # build outputs a second run on the same machine reuses
BASELINE_DIR = CACHE / "ibpembed_bench"
EXTENSION_DIR = CACHE / "ibpembed_C"
SETUPTOOLS_FOR_PYPROJECT = (77, 0)  # pyproject.toml's `license = "Apache-2.0"`


def load_baseline() -> str | None:
    """Loads the plain UVA gather baseline (torch.ops.ibpembed_bench, built once into
    BASELINE_DIR and reused); returns why it failed, or None."""
    from torch.utils.cpp_extension import load

    BASELINE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name="ibpembed_bench",
            sources=[
                str(ROOT / "benchmarks" / "cuda" / "uva_gather_op.cpp"),
                str(ROOT / "benchmarks" / "cuda" / "uva_gather.cu"),
            ],
            extra_cflags=["-O2"],
            extra_cuda_cflags=["-O3"],
            is_python_module=False,
            build_directory=str(BASELINE_DIR),
        )
    except Exception as exc:  # a compile error must not cost the run: timings skip uva
        return repr(exc)[-2000:]
    return None


def build() -> dict[str, Any]:
    """Builds ibpembed._C (CUDA included) in place and the UVA baseline, in parallel; falls back
    to ``cpp_extension.load`` (``fallback``: the other phases then load it too) when setup.py
    cannot run. Only the device's own architecture is built unless IBPEMBED_CUDA_ARCHS says
    otherwise."""
    import setuptools

    major, minor = torch.cuda.get_device_capability()
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4))
    env.setdefault("IBPEMBED_CUDA_ARCHS", f"{major}{minor}")
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    info: dict[str, Any] = {
        "setuptools": setuptools.__version__,
        "cuda_archs": env["IBPEMBED_CUDA_ARCHS"],
    }
    log(f"build: setuptools {setuptools.__version__}, torch {torch.__version__}, sm_{major}{minor}")
    start = time.perf_counter()
    rc = None
    with tempfile.TemporaryFile("w+") as out:
        proc = None
        if version >= SETUPTOOLS_FOR_PYPROJECT:
            proc = subprocess.Popen(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        else:
            log("build: setuptools too old for pyproject.toml; straight to cpp_extension.load")
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

    build = runpy.run_path(str(ROOT / "setup.py"))  # its flags; it builds only as __main__
    csrc = ROOT / "csrc"
    build_dir = EXTENSION_DIR
    build_dir.mkdir(parents=True, exist_ok=True)
    isa = build["host_isa_sources"]()
    objects = []
    for source, flags in isa.items():
        obj = build_dir / f"{Path(source).stem}.o"
        compile_cmd = ["c++", *build["CXX_FLAGS"], "-fPIC", f"-I{csrc / 'include'}", *flags]
        subprocess.run([*compile_cmd, "-c", str(ROOT / source), "-o", str(obj)], check=True)
        objects.append(str(obj))
    sources = [*sorted(csrc.glob("codec/*.cpp")), *sorted(csrc.glob("lookup/*.cpp"))]
    sources += sorted(csrc.glob("ops/*.cpp"))  # registration, CPU impls and the CUDA impls
    sources += sorted(csrc.glob("cuda/*.cu"))
    module = cpp_extension.load(
        name="_C",
        sources=[str(p) for p in sources if str(p.relative_to(ROOT)) not in isa],
        extra_include_paths=[str(csrc / "include")],
        extra_cflags=[*build["CXX_FLAGS"], *build["OPENMP_FLAGS"], "-DIBPEMBED_WITH_CUDA=1"],
        extra_cuda_cflags=[
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-DIBPEMBED_WITH_CUDA=1",
            *build["_gencode"](),
        ],
        extra_ldflags=objects,
        build_directory=str(build_dir),
    )
    sys.modules["ibpembed._C"] = module  # what `import ibpembed` then finds
    return module


def import_ibpembed():
    """ibpembed from this checkout (service/), with the extension just built."""
    for path in (str(ROOT), str(ROOT / "service")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import ibpembed
    from ibpembed import _ops

    return ibpembed, _ops


# ---------------------------------------------------------------------------------------------
# Pinned memory and device placement


class Pinned:
    """Page-locked host buffers for the big tables, as the server makes them.

    ``mode="register"``: plain host memory registered in place with its device alias wrapped
    once (``ibpembed._C.host_mapped_alias``, what the table store does with the mapped files);
    the CUDA ops then read the alias, a CUDA tensor. ``mode="copy"``: torch's pinned allocator
    (the fallback when registration fails; it rounds sizes up to a power of two); the ops then
    resolve the pinned CPU tensor's device pointer per call. No GPU: plain host memory.
    """

    def __init__(self, gpu: bool, mode: str = "register") -> None:
        self.gpu = gpu
        self.mode = mode
        self.aliases: dict[int, torch.Tensor] = {}  # host address -> device alias

    def empty(self, nbytes: int) -> torch.Tensor:
        if not self.gpu:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self.mode == "copy":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        from ibpembed import _C

        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.aliases[buf.data_ptr()] = _C.host_mapped_alias(buf, True, torch.cuda.current_device())
        return buf

    def on_device(self, host: torch.Tensor) -> torch.Tensor:
        """What the CUDA ops read for ``host`` (one of this object's buffers)."""
        return self.aliases.get(host.data_ptr(), host)

    def release(self) -> None:
        self.aliases.clear()  # the last alias view going unregisters its buffer


def device_args(c, dev: torch.device, where: str = "registered") -> tuple:
    """A CompressedTable's op arguments as the CUDA ops take them (lookup_ops_cuda.cpp), the
    small tensors on ``dev`` and the payload: ``"registered"``, placed as the table store places
    it (``placement.place_table``: registered in place, read through its device alias);
    ``"pinned"``, a page-locked copy (``pin_memory()``); ``"device"``, in GPU memory; ``"host"``,
    pageable. With a CPU ``dev`` (--dry-run) these are the CPU ops' args."""
    from ibpembed.tables import placement

    gpu = dev.type == "cuda"
    if where == "registered" and gpu:
        aliases = placement.HostAliases(placement.cuda_register(dev))
        placed = placement.place_table(c, dev, aliases)
        return (
            placed.payload,
            placed.block_base,
            placed.row_units,
            placed.bitmask,
            placed.mask,
            placed.bitval,
            c.chunk_bits,
            c.row_bytes,
            c.unit_bytes,
            c.num_rows,
        )
    payload = {
        "registered": c.payload,
        "pinned": c.payload.pin_memory() if gpu else c.payload,
        "device": c.payload.to(dev),
        "host": c.payload,
    }[where]
    small = (c.block_base, c.row_units, c.bitmask, c.mask, c.bitval)
    return (
        payload,
        *(t.to(dev) for t in small),
        c.chunk_bits,
        c.row_bytes,
        c.unit_bytes,
        c.num_rows,
    )


def sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Correctness


def edge_table(dtype: torch.dtype, rows: int, dim: int, rng: np.random.Generator) -> torch.Tensor:
    size = dtype.itemsize
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    edge = np.array(EDGE_BITS[size], dtype=uint)
    bits = edge[rng.integers(0, len(edge), (rows, dim))]
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).reshape(rows, dim * size))
    return raw.view(dtype).reshape(rows, dim).clone()


def make_small(kind: str, dtype: torch.dtype, rows: int, dim: int, seed: int) -> torch.Tensor:
    from benchmarks import data

    rng = np.random.default_rng(seed)
    if kind == "edge":
        return edge_table(dtype, rows, dim, rng)
    if kind == "random_bits":  # incompressible: raw rows
        return torch.from_numpy(rng.integers(0, 256, (rows, dim * dtype.itemsize), np.uint8)).view(
            dtype
        )
    values = data.dlrm_table(rows, dim, seed=seed)
    if dtype.is_floating_point:
        return values.to(dtype)
    return (values * 1000 + 128).clamp(0, 255).to(dtype)


def request_ids(rng: np.random.Generator, num_rows: int, n: int) -> torch.Tensor:
    """Unsorted ids with duplicates, one id repeated past a warp's run cap, both table ends."""
    ids = rng.integers(0, num_rows, n)
    ids[: min(n, 70)] = rng.integers(0, num_rows)
    ids = np.concatenate([ids, [0, num_rows - 1, num_rows - 1]])
    rng.shuffle(ids)
    return torch.from_numpy(ids)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@dataclass
class Checks:
    passed: int = 0
    failures: list[str] | None = None
    kinds: dict[str, int] | None = None  # checks passed, by kind (default: the label's 1st word)

    def record(self, ok: bool, what: str, kind: str | None = None) -> None:
        if ok:
            self.passed += 1
            kind = kind or what.split()[0]
            self.kinds = {**(self.kinds or {}), kind: (self.kinds or {}).get(kind, 0) + 1}
            return
        self.failures = [*(self.failures or []), what]
        log(f"  FAIL {what}")


def small_cases() -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """(label, table, compress kwargs) over dtypes, widths, value kinds, chunk and slot sizes."""
    widths = (16, 32, 64)
    aligns = (1, 8, 16, 32)
    i = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8):
        for dim in (1, 3, 16, 64, 129):
            for kind in ("dlrm", "edge", "random_bits"):
                kwargs = {"chunk_bits": widths[i % 3], "align": aligns[(i // 3) % 4]}
                i += 1
                table = make_small(kind, dtype, 1000, dim, seed=i)
                yield f"{dtype} D={dim} {kind} {kwargs}", table, kwargs
    base = make_small("dlrm", torch.float32, 2000, 128, seed=99)
    for method in ("paper", "raw"):
        yield f"fp32 D=128 method={method}", base, {"method": method}


class CudaFault(RuntimeError):
    """A CUDA error that leaves the process's context unusable (an illegal address, a launch
    failure): the phase stops, writes what it has, and the driver decides what runs next."""


def is_cuda_fault(exc: BaseException) -> bool:
    """Errors the ops raise on bad input are ValueError/IndexError/TypeError; a CUDA runtime
    error surfaces as another RuntimeError (torch.AcceleratorError in newer torch) naming CUDA."""
    if isinstance(exc, (ValueError, IndexError, TypeError, CudaFault)):
        return False
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


def check_correctness(
    ibpembed, ops, dev: torch.device, *, tiny: bool = False, wheres: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Every small case through the ops on ``dev`` against the CPU ops. On a CPU ``dev``
    (--dry-run) the CPU ops against independent answers instead: gathers against the source
    rows, pooled lookups against ``ibpembed.reference`` (``against`` in the result says which).
    ``wheres``: the payload placements of ``device_args`` to gather from; ``tiny``: four cases
    (the compute-sanitizer runs). A case that raises is a failure; a CUDA fault stops the phase
    with ``fault`` set."""
    from benchmarks import data

    wheres = wheres or ("registered", "pinned", "device")
    checks = Checks()
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    gpu = dev.type == "cuda"
    cases = list(small_cases())
    if tiny:
        cases = cases[:: max(1, len(cases) // 4)][:4]
    fault = None
    try:
        for label, table, kwargs in cases:
            try:
                check_case(ibpembed, ops, dev, table, kwargs, label, wheres, rng, checks)
            except CudaFault:
                raise
            except Exception as exc:
                checks.record(False, f"{label}: {exc!r}"[:400])
                if is_cuda_fault(exc):
                    raise CudaFault(repr(exc)) from exc
        if not tiny:
            quantised = data.int8_rowwise(data.dlrm_table(1000, 129, seed=5))
            q = ibpembed.compress(quantised, quant="int8_rowwise")
            values = None if gpu else source_values(quantised, "int8_rowwise")
            check_pooled(ops, q, 5, rng, checks, "int8 rowwise D=129", dev, values)
            check_table_set(ibpembed, dev, rng, checks)
            check_errors(ibpembed, ops, checks, dev)
    except CudaFault as exc:
        fault = str(exc)
        log(f"correctness: CUDA fault, stopping: {fault}")
    log(
        f"correctness on {dev}: {checks.passed} checks passed, {len(checks.failures or [])} "
        f"failed ({time.perf_counter() - start:.1f} s)"
    )
    return {
        "device": str(dev),
        "staging": os.environ.get(STAGING_ENV, "async"),
        "against": "CPU ops" if gpu else "source rows and ibpembed.reference",
        "passed": checks.passed,
        "passed_by_kind": checks.kinds or {},
        "failures": checks.failures or [],
        "fault": fault,
    }


def check_case(ibpembed, ops, dev, table, kwargs, label, wheres, rng, checks: Checks) -> None:
    """One small case: gathers from every payload placement, decompress, pooled lookups."""
    gpu = dev.type == "cuda"
    c = ibpembed.compress(table, **kwargs)
    ids = request_ids(rng, c.num_rows, 3000)
    if gpu:
        want = ops.ibp_gather(*c._args(), ids)
    else:  # the source rows themselves, as the op returns them (bytes of each row)
        want = table[ids].contiguous().view(torch.uint8).reshape(ids.numel(), c.row_bytes)
    for where in wheres:
        got = ops.ibp_gather(*device_args(c, dev, where), ids.to(dev)).cpu()
        checks.record(same_bits(got, want), f"gather {label} payload={where}")
    with sort_min_ids(0):  # the radix-sorted path (the default rule leaves 3k ids unsorted)
        got = ops.ibp_gather(*device_args(c, dev), ids.to(dev)).cpu()
    checks.record(same_bits(got, want), f"gather {label} sorted")
    got = ops.ibp_decompress(*device_args(c, dev)).cpu()
    checks.record(
        same_bits(got.view(c.dtype).view(c.num_rows, c.dim), table), f"decompress {label}"
    )
    if table.dtype.is_floating_point:
        values = None if gpu else source_values(table, str(table.dtype).split(".")[-1])
        check_pooled(ops, c, c._dtype_code(), rng, checks, label, dev, values)


def source_values(table: torch.Tensor, kind: str) -> np.ndarray:
    """A source table's rows widened to float64 (``reference.row_values``), for the reference."""
    from ibpembed import reference

    rows = table.contiguous().view(torch.uint8).reshape(table.shape[0], -1).numpy()
    with np.errstate(invalid="ignore"):  # NaN payloads widen to NaN
        return reference.row_values(rows, kind)


def matches_reference(
    got: torch.Tensor, values: np.ndarray, ids, offsets, weights, pooling: str
) -> bool:
    """An fp32 pooled result against ``reference.lookup_pooled`` (exact, float64): within
    ``reference.pooled_tolerance`` plus one rounding in the subnormal range per operation (whose
    error is absolute, at most half the smallest subnormal); non-finite where the reference is
    (NaN for NaN, the same infinity). Elements where the finite terms add up past fp32's range
    are left out: there an fp32 sum overflows or not depending on its order."""
    from ibpembed import reference

    ids, offsets = ids.numpy(), offsets.numpy()
    w = None if weights is None else weights.numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.lookup_pooled(values, ids, offsets, w, pooling)
        finite_terms = np.where(np.isfinite(values), np.abs(values), 0.0)
        magnitude_w = None if w is None else np.abs(w)
        spread = reference.lookup_pooled(finite_terms, ids, offsets, magnitude_w, "sum")
        lengths = np.diff(offsets)[:, None]
        tol = reference.pooled_tolerance(finite_terms, ids, offsets, w, pooling)
        tol = tol + (2 * lengths + 2) * 2.0**-150
        got = got.double().numpy()
        if got.shape != want.shape:
            return False
        decidable = spread < float(np.finfo(np.float32).max) / 2
        finite = np.isfinite(want)
        close = np.abs(got - want) <= tol
        same_nan = np.isnan(got) == np.isnan(want)
        same_inf = np.where(np.isinf(want), got == want, True)
    ok = np.where(finite, close, same_nan & same_inf)
    return bool(ok[decidable].all())


def check_pooled(
    ops, c, dtype_code: int, rng, checks: Checks, label: str, dev, values=None
) -> None:
    """Pooled SUM/MEAN, with and without weights: on a GPU against the CPU op bit for bit (NaN
    payloads aside); on the CPU (``values``: the source rows as float64) against the reference."""
    lengths = rng.integers(0, 40, 200)
    lengths[::9] = 0  # empty bags
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, c.num_rows, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    args = device_args(c, dev)
    for pooling in ("sum", "mean"):
        for w in (None, weights):
            if values is not None:
                got = ops.lookup_pooled(*args, ids, offsets, w, dtype_code, POOLING[pooling])
                ok = matches_reference(got, values, ids, offsets, w, pooling)
                checks.record(ok, f"pooled {pooling} weighted={w is not None} {label} (reference)")
                continue
            want = ops.lookup_pooled(*c._args(), ids, offsets, w, dtype_code, POOLING[pooling])
            got = ops.lookup_pooled(
                *args,
                ids.to(dev),
                offsets.to(dev),
                None if w is None else w.to(dev),
                dtype_code,
                POOLING[pooling],
            ).cpu()
            equal = torch.equal(got.isnan(), want.isnan()) and torch.equal(
                got.nan_to_num(0.0), want.nan_to_num(0.0)
            )
            checks.record(equal, f"pooled {pooling} weighted={w is not None} {label}")


def check_table_set(ibpembed, dev: torch.device, rng, checks: Checks) -> None:
    """lookup_pooled_tables, every table of a request in one launch per chunk width: tables of
    two widths and three dtypes, one read by two parts, against the CPU set (on a CPU
    ``dev``: against each table's own lookup)."""
    from benchmarks import data
    from ibpembed.codec import CompressedTableSet
    from ibpembed.tables import placement

    tables = [
        ibpembed.compress(data.dlrm_table(3000, 64, seed=7), chunk_bits=32),
        ibpembed.compress(data.dlrm_table(2000, 40, seed=8).to(torch.bfloat16), chunk_bits=16),
        ibpembed.compress(
            data.int8_rowwise(data.dlrm_table(1000, 36, seed=9)), quant="int8_rowwise"
        ),
        ibpembed.compress(data.dlrm_table(500, 16, seed=10), chunk_bits=32),
    ]
    parts = [(0, 0, 50), (1, 50, 30), (2, 80, 20), (3, 100, 0), (0, 100, 25)]
    lengths = rng.integers(0, 30, 125)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    for t, first, count in parts:
        begin, end = int(offsets[first]), int(offsets[first + count])
        ids[begin:end] = torch.from_numpy(rng.integers(0, tables[t].num_rows, end - begin))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    table_bags = torch.tensor(parts, dtype=torch.int64)
    cpu_set = CompressedTableSet(tables)
    gpu = dev.type == "cuda"
    if gpu:
        aliases = placement.HostAliases(placement.cuda_register(dev))
        placed = CompressedTableSet([placement.place_table(c, dev, aliases) for c in tables])
    for pooling in ("sum", "mean"):
        for w in (None, weights):
            want, _ = cpu_set.lookup(table_bags, ids, offsets, w, pooling)
            if gpu:
                got, _ = placed.lookup(
                    table_bags,
                    ids.to(dev),
                    offsets.to(dev),
                    None if w is None else w.to(dev),
                    pooling,
                )
                got = [g.cpu() for g in got]
            else:  # each part through its table's own op
                got = []
                for t, first, count in parts:
                    begin, end = int(offsets[first]), int(offsets[first + count])
                    part_offsets = offsets[first : first + count + 1] - begin
                    part_w = None if w is None else w[begin:end]
                    got.append(tables[t].lookup(ids[begin:end], part_offsets, part_w, pooling))
            ok = all(
                torch.equal(g.isnan(), e.isnan())
                and torch.equal(g.nan_to_num(0.0), e.nan_to_num(0.0))
                for g, e in zip(got, want, strict=True)
            )
            checks.record(ok, f"table_set {pooling} weighted={w is not None}", "table_set")


def check_errors(ibpembed, ops, checks: Checks, dev: torch.device) -> None:
    c = ibpembed.compress(torch.randn(100, 16))
    args = device_args(c, dev)

    def on(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    cases: list[tuple[str, type, Callable[[], object]]] = [
        ("id past the end", IndexError, lambda: ops.ibp_gather(*args, on([0, 100]))),
        ("negative id", IndexError, lambda: ops.ibp_gather(*args, on([-1]))),
        (
            "decreasing offsets",
            ValueError,
            lambda: ops.lookup_pooled(*args, on([1, 2, 3]), on([0, 2, 1, 3]), None, 0, 0),
        ),
    ]
    if dev.type == "cuda":
        from ibpembed import _C

        host_args = device_args(c, dev, where="host")
        cases.append(("pageable payload", ValueError, lambda: ops.ibp_gather(*host_args, on([0]))))

        def deferred(ids: list[int]) -> None:
            # What the engine does: errors deferred, raised at the latest by the check.
            _C.set_defer_cuda_errors(True)
            try:
                ops.ibp_gather(*args, on(ids))
                ops.lookup_pooled(*args, on([1, 2]), on([0, 1, 2]), None, 0, 0)
                _C.check_cuda_errors()
            finally:
                _C.set_defer_cuda_errors(False)

        cases.append(("deferred id past the end", IndexError, lambda: deferred([0, 100])))
    for what, error, call in cases:
        try:
            call()
            ok = False
        except error:
            ok = True
        checks.record(ok, f"{what} raises {error.__name__}", "errors")
    if dev.type == "cuda":
        try:  # the stream's error state was cleared by the raise: a good call raises nothing
            deferred([0, 99])
            ok = True
        except (IndexError, ValueError):
            ok = False
        checks.record(ok, "deferred errors cleared after a raise", "errors")


# ---------------------------------------------------------------------------------------------
# Big tables


@dataclass
class BigTable:
    row_bytes: int
    num_rows: int
    plain: torch.Tensor  # [N, row_bytes] uint8, pinned: the uva/cpu baselines' table
    comp_cpu: tuple  # op arguments, everything on the host (the CPU ops' view)
    comp: tuple  # op arguments for the CUDA ops (payload pinned, small parts on the GPU)
    raw_cpu: tuple  # the same rows stored raw, on the host
    raw: tuple  # ... and placed for the same kernels
    unit_bytes: int
    compressed_payload_bytes: int
    ratio_stored: float  # raw bytes / (payload + index + bitmask + masks)


def build_big(
    ibpembed, pinned: Pinned, row_bytes: int, total_bytes: int, profile: str, gpu: bool
) -> BigTable:
    """~total_bytes of fp32 DLRM-profile rows (``profile="dlrm-bf16"``: rounded to bf16 values,
    the low 16 bits zero): one compressed tile repeated, at memcpy cost."""
    from benchmarks import data

    dim = row_bytes // 4
    tile_rows = max(32, min(TILE_BYTES, total_bytes) // row_bytes // 32 * 32)
    reps = max(1, total_bytes // (tile_rows * row_bytes))
    n = tile_rows * reps
    tile = data.dlrm_table(tile_rows, dim, seed=row_bytes)
    if profile == "dlrm-bf16":
        tile = data.bf16_rounded(tile)
    c = ibpembed.compress(tile, sample_rows=FIT_SAMPLE_ROWS)
    used = int(c.block_base[-1])
    # Tiling keeps the layout exact: block i of copy r starts at tile base + r * used.
    payload = pinned.empty(reps * used + 16)
    payload[: reps * used].view(reps, used).copy_(c.payload[:used].expand(reps, used))
    payload[reps * used :].zero_()
    shifts = torch.arange(reps, dtype=torch.int64).mul_(used).unsqueeze(1)
    block_base = torch.cat(
        [(c.block_base[:-1].unsqueeze(0) + shifts).flatten(), torch.tensor([reps * used])]
    )
    small = (block_base, c.row_units.repeat(reps), c.bitmask.repeat(reps), c.mask, c.bitval)
    ints = (c.chunk_bits, row_bytes, c.unit_bytes, n)
    plain_buf = pinned.empty(n * row_bytes + 16)
    plain_buf[n * row_bytes :].zero_()
    plain = plain_buf[: n * row_bytes].view(n, row_bytes)
    plain.view(reps, tile_rows * row_bytes).copy_(
        tile.view(torch.uint8).reshape(1, -1).expand(reps, -1)
    )
    # Raw layout over the very same bytes: every slot is the row itself (unit 8 divides it).
    unit = ibpembed.codec.slot_unit_bytes(row_bytes, 8)
    blocks = n // 32
    raw_small = (
        torch.arange(blocks + 1, dtype=torch.int64).mul_(32 * row_bytes),
        torch.full((n,), row_bytes // unit, dtype=torch.uint8),
        torch.zeros(blocks, dtype=torch.int32),
        torch.zeros_like(c.mask),
        torch.zeros_like(c.bitval),
    )
    raw_ints = (c.chunk_bits, row_bytes, unit, n)
    to_gpu = (lambda ts: tuple(t.cuda() for t in ts)) if gpu else (lambda ts: ts)
    metadata = 8 * (c.mask.numel() + c.bitval.numel())  # masks and codebooks, as c counts them
    stored = reps * used + 16 + block_base.numel() * 8 + n + blocks * 4 + metadata
    return BigTable(
        row_bytes=row_bytes,
        num_rows=n,
        plain=plain,
        comp_cpu=(payload, *small, *ints),
        comp=(pinned.on_device(payload), *to_gpu(small), *ints),
        raw_cpu=(plain_buf, *raw_small, *raw_ints),
        raw=(pinned.on_device(plain_buf), *to_gpu(raw_small), *raw_ints),
        unit_bytes=c.unit_bytes,
        compressed_payload_bytes=reps * used,
        ratio_stored=n * row_bytes / stored,
    )


def zipf_ids(rng: np.random.Generator, num_rows: int, size: int, alpha: float) -> np.ndarray:
    """Zipf(alpha) ranks by inverse CDF of the continuous power law, scattered over the table by
    an affine bijection (hot rows are not neighbours in a real table)."""
    u = rng.random(size)
    if alpha == 1.0:
        ranks = np.exp(u * math.log(num_rows + 1.0)) - 1.0
    else:
        a = 1.0 - alpha
        ranks = (((num_rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a) - 1.0
    ranks = np.clip(np.floor(ranks), 0, num_rows - 1).astype(np.int64)
    mult = 2654435761
    while math.gcd(mult, num_rows) != 1:
        mult += 2
    return (ranks * mult + 12345) % num_rows


def id_stream(rng, num_rows: int, size: int, dist: str) -> torch.Tensor:
    if dist == "uniform":
        return torch.from_numpy(rng.integers(0, num_rows, size))
    return torch.from_numpy(zipf_ids(rng, num_rows, size, float(dist.removeprefix("zipf"))))


def check_big(ops, big: BigTable, gpu: bool, checks: Checks, rng) -> None:
    """The tiled tables decode to the plain rows (CPU ops), and the CUDA ops agree (GPU)."""
    ids = id_stream(rng, big.num_rows, 4096, "uniform")
    ids[-1] = big.num_rows - 1  # the last row sits past 4 GiB of payload: 64-bit offsets
    want = big.plain[ids]
    r = big.row_bytes
    checks.record(same_bits(ops.ibp_gather(*big.comp_cpu, ids), want), f"tiled R={r} (CPU)")
    checks.record(same_bits(ops.ibp_gather(*big.raw_cpu, ids), want), f"raw layout R={r} (CPU)")
    if not gpu:
        return
    gids = ids.cuda()
    checks.record(same_bits(ops.ibp_gather(*big.comp, gids).cpu(), want), f"big gather R={r}")
    checks.record(same_bits(ops.ibp_gather(*big.raw, gids).cpu(), want), f"big raw gather R={r}")
    with sort_min_ids(0):  # the sorted path, whatever the default rule picks at 4096 ids
        sorted_rows = ops.ibp_gather(*big.comp, gids).cpu()
    checks.record(same_bits(sorted_rows, want), f"big sorted gather R={r}")
    if has_baseline():
        uva = torch.ops.ibpembed_bench.uva_gather(big.plain, gids).cpu()
        checks.record(same_bits(uva, want), f"uva baseline R={r}")
    offsets = torch.arange(0, ids.numel() + 1, BAG_SIZE)
    cpu_sum = ops.lookup_pooled(*big.comp_cpu, ids, offsets, None, 0, 0)
    gpu_sum = ops.lookup_pooled(*big.comp, gids, offsets.cuda(), None, 0, 0).cpu()
    checks.record(torch.equal(cpu_sum, gpu_sum), f"big pooled sum R={r}")


# ---------------------------------------------------------------------------------------------
# Timing


def timed(fn: Callable[[], object], gpu: bool, budget_s: float = 0.25) -> float:
    """Median wall time of fn() (synchronised), after warm-up; 3..20 runs within ~budget_s."""
    for _ in range(2):
        fn()
    sync(gpu)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < 3 or (len(times) < 20 and time.perf_counter() - begin < budget_s):
        t0 = time.perf_counter()
        fn()
        sync(gpu)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def h2d_bandwidth(pinned: Pinned, gpu: bool) -> float | None:
    if not gpu:
        return None
    src = pinned.empty(GIB)
    src.fill_(1)
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    seconds = timed(lambda: dst.copy_(src, non_blocking=True), gpu, budget_s=1.0)
    return GIB / seconds / 1e9


def slot_sectors(big: BigTable, ids: torch.Tensor) -> int:
    """32-byte sectors the compressed slots of rows ``ids`` touch (format.h's offsets)."""
    _, block_base, row_units = big.comp_cpu[:3]
    sizes = row_units.view(-1, 32)[ids // 32].to(torch.int64) * big.unit_bytes  # [k, 32]
    before = torch.cumsum(sizes, 1) - sizes
    pick = (ids % 32).unsqueeze(1)
    offsets = block_base[ids // 32] + before.gather(1, pick).squeeze(1)
    size = sizes.gather(1, pick).squeeze(1)
    return int(((offsets % SECTOR_BYTES + size + SECTOR_BYTES - 1) // SECTOR_BYTES).sum())


def time_table(
    ops, big: BigTable, dists: list[str], batches: tuple[int, ...], gpu: bool, rng
) -> list[dict[str, Any]]:
    rows = []
    r = big.row_bytes
    stage = torch.empty(max(batches), r, dtype=torch.uint8, pin_memory=gpu)
    dev = torch.empty(max(batches), r, dtype=torch.uint8, device="cuda" if gpu else "cpu")
    units = big.comp_cpu[2]
    for dist in dists:
        for n in batches:
            ids = id_stream(rng, big.num_rows, n, dist)
            offsets = torch.arange(0, n + 1, BAG_SIZE)

            def cpu_h2d(ids=ids, n=n):
                torch.index_select(big.plain, 0, ids, out=stage[:n])
                dev[:n].copy_(stage[:n], non_blocking=True)

            times = {"cpu_h2d": timed(cpu_h2d, gpu)}
            if gpu:
                times |= gpu_times(ops, big, ids.cuda(), offsets.cuda())
            # Bytes over PCIe: the gather reads each distinct row about once (dedupe runs, cut
            # every 32 copies); the pooled kernel re-reads repeats, so under Zipf ids this
            # undercounts its wire bytes.
            unique = torch.unique(ids)
            rows.append(
                {
                    "row_bytes": r,
                    "batch": n,
                    "ids": dist,
                    "seconds": times,
                    "raw_bytes": n * r,
                    "unique_ids": unique.numel(),
                    "raw_wire_bytes": unique.numel() * r,
                    "ibp_wire_bytes": int(units[unique].sum(dtype=torch.int64)) * big.unit_bytes,
                    # Raw rows lie at multiples of row_bytes, itself a multiple of 32.
                    "raw_wire_sectors": unique.numel() * (r // SECTOR_BYTES),
                    "ibp_wire_sectors": slot_sectors(big, unique),
                }
            )
    return rows


@contextlib.contextmanager
def staging(mode: str) -> Iterator[None]:
    """Run the CUDA ops with IBPEMBED_CUDA_STAGING=mode (async: cp.async, sync: plain loads)."""
    previous = os.environ.get(STAGING_ENV)
    os.environ[STAGING_ENV] = mode
    try:
        yield
    finally:
        if previous is None:
            del os.environ[STAGING_ENV]
        else:
            os.environ[STAGING_ENV] = previous


SORT_ENV = "IBPEMBED_CUDA_SORT_MIN_IDS"


@contextlib.contextmanager
def sort_min_ids(n: int) -> Iterator[None]:
    """Run the CUDA gathers with IBPEMBED_CUDA_SORT_MIN_IDS=n (0: always sort)."""
    previous = os.environ.get(SORT_ENV)
    os.environ[SORT_ENV] = str(n)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SORT_ENV]
        else:
            os.environ[SORT_ENV] = previous


def has_baseline() -> bool:
    """Whether the UVA baseline is loaded (``torch.ops.ibpembed_bench``)."""
    try:
        return hasattr(torch.ops.ibpembed_bench, "uva_gather")
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def deferred_errors(gpu: bool) -> Iterator[None]:
    """The CUDA ops with their errors deferred, as the engine runs them (no sync inside each
    call), checked at the end; nothing on the CPU."""
    if not gpu:
        yield
        return
    from ibpembed import _C

    _C.set_defer_cuda_errors(True)
    try:
        yield
        _C.check_cuda_errors()
    finally:
        _C.set_defer_cuda_errors(False)


def gpu_times(
    ops, big: BigTable, ids: torch.Tensor, offsets: torch.Tensor, gpu: bool = True
) -> dict[str, float]:
    """Seconds per call of the GPU methods on one batch (ids and offsets on the GPU). With
    ``gpu=False`` the same calls on the CPU ops (what the tests run: their times mean nothing)."""
    gather = lambda: ops.ibp_gather(*big.comp, ids)  # noqa: E731
    pooled = lambda: ops.lookup_pooled(*big.comp, ids, offsets, None, 0, 0)  # noqa: E731
    with staging("sync"):
        sync_staging = timed(gather, gpu)
    with sort_min_ids(0):
        sorted_ids = timed(gather, gpu)
    with sort_min_ids(1 << 62):
        unsorted_ids = timed(gather, gpu)
    with deferred_errors(gpu):
        deferred = timed(pooled, gpu)
    times = {
        "ibp_none": timed(gather, gpu),
        "ibp_none_sync": sync_staging,
        "ibp_none_sorted": sorted_ids,
        "ibp_none_nosort": unsorted_ids,
        "raw_none": timed(lambda: ops.ibp_gather(*big.raw, ids), gpu),
        "ibp_sum": timed(pooled, gpu),
        "ibp_sum_deferred": deferred,
        "raw_sum": timed(lambda: ops.lookup_pooled(*big.raw, ids, offsets, None, 0, 0), gpu),
    }
    if has_baseline():
        uva = torch.ops.ibpembed_bench.uva_gather
        times["uva"] = timed(lambda: uva(big.plain, ids), gpu)
    return times


def summarise(rows: list[dict[str, Any]], h2d: float | None) -> dict[str, Any]:
    """GB/s columns, ratios and the issue's three targets (reported, not asserted)."""
    for row in rows:
        row["raw_equiv_gbps"] = {k: row["raw_bytes"] / v / 1e9 for k, v in row["seconds"].items()}
    if not any("ibp_none" in row["seconds"] for row in rows):
        return {}  # no GPU: nothing to evaluate
    targets: dict[str, list[str]] = {
        "compressed_vs_raw": [],
        "raw_vs_h2d": [],
        "pooled_vs_cpu": [],
        "pooled_1k_call": [],
    }
    for row in rows:
        t = row["seconds"]
        gbps = row["raw_equiv_gbps"]
        row["ibp_wire_gbps"] = row["ibp_wire_bytes"] / t["ibp_none"] / 1e9
        byte_ratio = row["raw_wire_bytes"] / row["ibp_wire_bytes"]
        row["byte_ratio"] = byte_ratio
        row["sector_ratio"] = row["raw_wire_sectors"] / row["ibp_wire_sectors"]
        row["ibp_vs_raw"] = t["raw_none"] / t["ibp_none"]
        row["ibp_sum_vs_cpu_h2d"] = t["cpu_h2d"] / t["ibp_sum"]
        key = f"R={row['row_bytes']} n={row['batch']} {row['ids']}"
        # The layout's honest ceiling is the sector ratio: the GPU reads whole 32-byte sectors.
        if row["ibp_vs_raw"] < 0.95 * row["sector_ratio"]:
            targets["compressed_vs_raw"].append(key)
        # As the engine calls it: errors deferred.
        call_s = t.get("ibp_sum_deferred", t["ibp_sum"])
        if row["batch"] == min(BATCHES) and call_s > POOLED_1K_CALL_S:
            targets["pooled_1k_call"].append(f"{key}: {call_s * 1e6:.1f} us")
        if row["ibp_sum_vs_cpu_h2d"] <= 1.0:
            targets["pooled_vs_cpu"].append(key)
        at_512 = row["row_bytes"] == 512 and row["batch"] == max(BATCHES)
        if at_512 and h2d and gbps["raw_none"] < 0.6 * h2d:
            targets["raw_vs_h2d"].append(key)
    return {name: {"met": not misses, "misses": misses} for name, misses in targets.items()}


def print_table(rows: list[dict[str, Any]], h2d: float | None) -> None:
    cols = (
        "ibp_none",
        "ibp_none_sync",
        "ibp_none_sorted",
        "ibp_none_nosort",
        "ibp_sum",
        "ibp_sum_deferred",
        "raw_none",
        "raw_sum",
        "uva",
        "cpu_h2d",
    )
    head = f"{'R':>5} {'batch':>6} {'ids':>8} " + " ".join(f"{c:>9}" for c in cols)
    head += f" {'wire':>7} {'bytes×':>7} {'sect×':>7} {'ibp/raw':>7} {'sum/cpu':>7}"
    log(f"\nGB/s of raw-equivalent bytes (pinned H2D copy ceiling: {h2d or float('nan'):.1f} GB/s)")
    log(head)
    for row in rows:
        g = row["raw_equiv_gbps"]
        cells = " ".join(f"{g[c]:9.2f}" if c in g else f"{'-':>9}" for c in cols)
        extra = ""
        if "byte_ratio" in row:
            extra = (
                f" {row['ibp_wire_gbps']:7.2f} {row['byte_ratio']:7.3f}"
                f" {row['sector_ratio']:7.3f} {row['ibp_vs_raw']:7.3f}"
                f" {row['ibp_sum_vs_cpu_h2d']:7.2f}"
            )
        log(f"{row['row_bytes']:>5} {row['batch']:>6} {row['ids']:>8} {cells}{extra}")


# ---------------------------------------------------------------------------------------------


def machine(gpu: bool) -> dict[str, Any]:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "host": platform.node(),
    }
    if gpu:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "sms": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    return info


def sort_rule(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row size and id distribution, the batches at which sorting the ids paid (the sorted
    gather faster than the unsorted one): what IBPEMBED_CUDA_SORT_MIN_IDS should be."""
    rule = []
    for row in rows:
        t = row["seconds"]
        if "ibp_none_sorted" in t:
            rule.append(
                {
                    "row_bytes": row["row_bytes"],
                    "ids": row["ids"],
                    "batch": row["batch"],
                    "sorted_us": round(t["ibp_none_sorted"] * 1e6, 1),
                    "nosort_us": round(t["ibp_none_nosort"] * 1e6, 1),
                    "sort_pays": t["ibp_none_sorted"] < t["ibp_none_nosort"],
                }
            )
    return rule


# ---------------------------------------------------------------------------------------------
# Phases: each runs in a child process of its own and writes its JSON when it ends, so that a
# CUDA fault (which kills the process's context), an OOM or a hang costs one phase, not the run.


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (RssAnon; Linux, else 0): what a copy of a
    payload (pin_memory, or copy-on-write pages of a mapped file) adds, where pages of the file
    itself count as file pages."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def phase_preflight(gpu: bool) -> dict[str, Any]:
    """Registration in place and a zero-copy read of it, on a small buffer, before anything
    depends on them: ``register`` says whether the later phases register in place or fall back
    to page-locked copies."""
    if not gpu:
        return {"register": True, "skipped": "no GPU: nothing to register"}
    from ibpembed import _C, compress
    from ibpembed._ops import ops

    device = torch.cuda.current_device()
    info: dict[str, Any] = {"read_only_supported": _C.host_register_read_only_supported(device)}
    buffer = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    alias = _C.host_mapped_alias(buffer, True, device)
    info["alias_reads_back"] = bool(torch.equal(alias[-4096:].cpu(), buffer[-4096:]))
    del alias
    # A table file as the store maps it (copy-on-write, format.read_table): whether it registers
    # in place (read-only where supported), or the store will fall back to pinned copies.
    with tempfile.TemporaryFile() as f:
        f.write(buffer[: 4 << 20].numpy().tobytes())
        f.flush()
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        view = torch.frombuffer(mapping, dtype=torch.uint8, offset=4096, count=(4 << 20) - 8192)
        try:
            whole = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
            mapped = _C.host_mapped_alias(whole, True, device)
            start = view.storage_offset()
            got = mapped[start : start + 4096].cpu()
            info["file_mapping_registers"] = bool(torch.equal(got, view[:4096]))
            del mapped
        except RuntimeError as exc:
            info["file_mapping_registers"] = False
            info["file_mapping_error"] = repr(exc)
    table = compress(torch.randn(4096, 64))
    got = ops.ibp_gather(*device_args(table, torch.device("cuda")), torch.arange(4096).cuda())
    info["registered_gather_exact"] = same_bits(got.cpu(), ops.ibp_decompress(*table._args()))
    info["register"] = info["alias_reads_back"] and info["registered_gather_exact"]
    return info


def check_served(dev: torch.device) -> dict[str, Any]:
    """The server's path: a packed table set loaded by a TableStore placed for ``dev`` and a
    LookupEngine on ``dev``, against the CPU store and engine on the same files, before and
    after row updates. Also the host memory that placing the tables cost."""
    from benchmarks import data
    from ibpembed.engine import FeatureQuery, LookupEngine
    from ibpembed.tables.importers import TableSet, TableSource
    from ibpembed.tables.pack import pack_table_set
    from ibpembed.tables.store import TableStore

    checks = Checks()
    user = data.dlrm_table(20000, 64, seed=3)
    item = data.dlrm_table(5000, 32, seed=4).to(torch.bfloat16)
    rng = np.random.default_rng(2)
    with tempfile.TemporaryDirectory() as tmp:
        sources = (
            TableSource("user", user, feature_names=("user_id", "user_hist")),
            TableSource("item", item, feature_names=("item_id",)),
        )
        pack_table_set(Path(tmp), TableSet(sources), sample_rows=None)
        cpu_store = TableStore.load(tmp)
        before = anonymous_bytes()
        served = TableStore.load(tmp, device=dev)
        placed_bytes = anonymous_bytes() - before
        engines = (LookupEngine(served, device=dev.type), LookupEngine(cpu_store, device="cpu"))
        try:
            with served.acquire() as snap:
                payload = snap.kernel_table("user").payload
                in_place = payload.device.type == dev.type
            # Twice updated: the second update appends to the buffer the first made, whose
            # registration must outlive the first update's version.
            for step in ("loaded", "updated", "updated again"):
                for pooling in ("none", "sum", "mean"):
                    for batch in (1, 64, 512):
                        lengths = rng.integers(0, 20, batch).astype(np.int32)
                        features = [
                            FeatureQuery(
                                "user_hist", rng.integers(0, 20000, int(lengths.sum())), lengths
                            ),
                            FeatureQuery(
                                "item_id", rng.integers(0, 5000, batch), np.ones(batch, np.int32)
                            ),
                        ]
                        got, want = (e.run(features, pooling) for e in engines)
                        ok = all(
                            same_bits(a.values.cpu(), b.values)
                            for a, b in zip(got.features, want.features, strict=True)
                        )
                        checks.record(ok, f"served {step} {pooling} B={batch}", "served")
                if step != "updated again":
                    ids = torch.from_numpy(rng.choice(20000, 300, replace=False))
                    rows = torch.from_numpy(rng.standard_normal((300, 64)).astype(np.float32))
                    for store in (served, cpu_store):
                        store.update_rows("user", ids, rows)
        finally:
            for engine in engines:
                engine.close()
    return {
        "device": str(dev),
        "passed": checks.passed,
        "failures": checks.failures or [],
        "payload_read_in_place": in_place,
        "anonymous_bytes_to_place": placed_bytes,
        "payload_file_bytes": int(payload.numel()),
    }


def phase_timing(
    ibpembed, ops, args: argparse.Namespace, gpu: bool, row_bytes: int
) -> dict[str, Any]:
    """One row size: the big tables built (registered in place, or pinned copies when
    ``--pin copy``), checked, and every method timed."""
    total = int((0.01 if not gpu else args.table_gib) * GIB)
    pinned = Pinned(gpu, args.pin)
    checks = Checks()
    rng = np.random.default_rng(row_bytes)
    t0 = time.perf_counter()
    big = build_big(ibpembed, pinned, row_bytes, total, args.profile, gpu)
    built_s = time.perf_counter() - t0
    log(
        f"R={row_bytes}: {big.num_rows} rows, {big.num_rows * row_bytes / GIB:.2f} GiB raw, "
        f"payload {big.compressed_payload_bytes / GIB:.2f} GiB, stored ratio "
        f"{big.ratio_stored:.3f} (built in {built_s:.1f} s)"
    )
    check_big(ops, big, gpu, checks, rng)
    dists = ["uniform", *(f"zipf{a}" for a in args.zipf.split(","))]
    if args.variant == "thp":  # the huge-page A/B: uniform ids, where TLB reach matters most
        dists = ["uniform"]
    rows = time_table(ops, big, dists, BATCHES if gpu else BATCHES[:2], gpu, rng)
    for row in rows:
        row["variant"] = args.variant
    return {
        "row_bytes": row_bytes,
        "variant": args.variant,
        "pin": args.pin,
        "built_s": round(built_s, 1),
        "checks": {"passed": checks.passed, "failures": checks.failures or []},
        "results": rows,
    }


def run_phase(args: argparse.Namespace) -> int:
    """Runs one phase in this process and writes its JSON to --phase-out (also after a CUDA
    fault, with ``fault`` set); exit 0 when it passed."""
    gpu = not args.dry_run
    result: dict[str, Any] = {"phase": args.phase, "pin": args.pin}
    start = time.perf_counter()
    try:
        if args.inject_fault == args.phase:
            raise RuntimeError(f"CUDA error: illegal memory access (--inject-fault {args.phase})")
        if args.phase == "build":
            result |= build()
        else:
            if args.load_extension:
                load_extension()
            ibpembed, _ops = import_ibpembed()
            ops = _ops.ops
            dev = torch.device("cuda" if gpu else "cpu")
            if gpu and load_baseline() is not None:
                log("UVA baseline unavailable: its timings are skipped")
            if args.phase == "preflight":
                result |= phase_preflight(gpu)
            elif args.phase == "correctness":
                wheres = ("registered", "pinned", "device") if args.pin == "register" else ()
                wheres = wheres or ("pinned", "device")
                with staging(args.staging):
                    result |= check_correctness(ibpembed, ops, dev, tiny=args.tiny, wheres=wheres)
            elif args.phase == "served":
                result |= check_served(dev)
            elif args.phase == "h2d":
                pinned = Pinned(gpu, args.pin)
                result["h2d_gbps"] = h2d_bandwidth(pinned, gpu)
                pinned.release()
            elif args.phase == "timing":
                result |= phase_timing(ibpembed, ops, args, gpu, args.rows)
    except Exception as exc:
        result["fault" if is_cuda_fault(exc) else "error"] = repr(exc)[-4000:]
        log(f"phase {args.phase}: {exc!r}")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    args.phase_out.parent.mkdir(parents=True, exist_ok=True)
    args.phase_out.write_text(json.dumps(result, indent=2))
    return 1 if phase_failed(result) else 0


# Seconds each phase is expected to take on the GPU machine (estimates, used only to skip a
# phase that cannot finish before the deadline); the children are killed at the deadline anyway.
EXPECTED_S = {
    "build": 120,
    "preflight": 10,
    "correctness": 60,
    "served": 20,
    "sanitizer": 45,
    "h2d": 10,
    "timing": 60,
}
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
SANITIZER_LIMIT_S = 75.0  # each sanitizer run; a slower one is killed and recorded as such
# The row size the raw-vs-H2D target is defined at goes first.
TIMING_ORDER = (512, 64, 1024, 256)


DRIVER_PHASES = ("build", "preflight", "correctness", "served", "sanitizer", "h2d", "timing")


class Driver:
    """Runs the phases in child processes against one deadline, merging every phase's JSON
    into one report that is rewritten after each phase."""

    def __init__(self, args: argparse.Namespace, out: Path, gpu: bool) -> None:
        self.args = args
        self.out = out
        self.gpu = gpu
        self.deadline = time.monotonic() + args.deadline_s
        self.phase_dir = out.with_suffix(".phases")
        self.extra: list[str] = []  # options every later phase gets (--pin copy, --load-extension)
        self.child: subprocess.Popen | None = None
        self.only = set(args.only.split(",")) if args.only else set(DRIVER_PHASES)
        unknown = self.only - set(DRIVER_PHASES)
        if unknown:
            raise SystemExit(f"--only: unknown phases {sorted(unknown)}; of {DRIVER_PHASES}")
        self.report: dict[str, Any] = {
            "machine": machine(gpu),
            "command": " ".join(sys.argv),
            "deadline_s": args.deadline_s,
            "profile": args.profile,
            "phases": {},
        }

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2))

    def common(self) -> list[str]:
        a = self.args
        flags = ["--table-gib", str(a.table_gib), "--zipf", a.zipf, "--profile", a.profile]
        flags += ["--dry-run"] if a.dry_run else []
        flags += ["--inject-fault", a.inject_fault] if a.inject_fault else []
        return [*flags, *self.extra]

    def run(
        self,
        key: str,
        phase: str,
        options: list[str] | None = None,
        *,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
        limit_s: float | None = None,
    ) -> dict[str, Any]:
        """Runs one phase as a child (under ``wrapper``, e.g. compute-sanitizer) unless the
        deadline leaves too little time; records and returns its result."""
        expected = EXPECTED_S[phase] * (0.05 if self.args.dry_run else 1.0)
        left = self.left_s()
        if left < expected / 2:
            result: dict[str, Any] = {
                "skipped": f"deadline: {left:.0f} s left, ~{expected} s needed"
            }
            log(f"== {key}: skipped ({result['skipped']})")
            self.report["phases"][key] = result
            self.save()
            return result
        path = self.phase_dir / f"{key}.json"
        path.unlink(missing_ok=True)
        command = [
            *(wrapper or []),
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--phase",
            phase,
            "--phase-out",
            str(path),
            *self.common(),
            *(options or []),
        ]
        log(f"== {key} ({left:.0f} s left)")
        start = time.perf_counter()
        # A session of its own, so that a timeout ends the whole tree (compute-sanitizer's
        # Python child too, which would otherwise keep the GPU).
        proc = self.child = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        rc: int | None
        try:
            rc = proc.wait(timeout=max(1.0, min(left, limit_s or left)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        self.child = None
        result = json.loads(path.read_text()) if path.exists() else {}
        result["rc"] = rc
        result["child_wall_s"] = round(time.perf_counter() - start, 1)
        if rc is None:
            result.setdefault("error", "killed at its time limit")
        elif not path.exists():
            result["fault"] = f"the phase died (exit {rc}) before writing its result"
        self.report["phases"][key] = result
        self.save()
        return result

    def sanitizer(self) -> None:
        """compute-sanitizer memcheck, racecheck and synccheck over the tiny correctness cases,
        both staging modes under memcheck."""
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        if not self.gpu or not Path(tool).exists():
            why = "no GPU" if not self.gpu else "compute-sanitizer not found"
            self.report["phases"]["sanitizer"] = {"skipped": why}
            self.save()
            return
        runs = [(t, "async") for t in SANITIZER_TOOLS] + [("memcheck", "sync")]
        for name, mode in runs:
            wrapper = [tool, "--tool", name, "--error-exitcode", "97"]
            options = ["--tiny", "--staging", mode]
            key = f"sanitizer_{name}_{mode}"
            # Without torch's caching allocator every tensor is its own allocation, so memcheck
            # sees an access past a tensor even inside a cached block.
            env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
            self.run(key, "sanitizer", options, env=env, wrapper=wrapper, limit_s=SANITIZER_LIMIT_S)

    def stop(self, signum: int, frame: object) -> None:
        """SIGTERM (an outer `timeout`): end the running phase's process tree, which has a
        session of its own, then write what was measured (``drive`` catches the exit)."""
        if self.child is not None:
            os.killpg(self.child.pid, signal.SIGKILL)
        raise SystemExit(f"stopped by signal {signum}")

    def drive(self) -> int:
        previous = signal.signal(signal.SIGTERM, self.stop)
        try:
            self.drive_phases()
        except SystemExit as exc:
            self.report["stopped"] = str(exc)
            log(f"driver: {exc}; writing what was measured")
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.finish()

    def drive_phases(self) -> None:
        a = self.args
        if "build" in self.only:
            if a.dry_run or a.skip_build:
                why = "--dry-run uses the installed extension" if a.dry_run else "--skip-build"
                self.report["phases"]["build"] = {"skipped": why}
            else:
                built = self.run("build", "build")
                if built.get("fallback"):
                    self.extra.append("--load-extension")
        if "preflight" in self.only:
            pre = self.run("preflight", "preflight")
            if not pre.get("register"):
                log("preflight: registration in place failed; pinned copies from here on")
                self.extra += ["--pin", "copy"]
        if "correctness" in self.only:
            correct = self.run("correctness", "correctness", ["--staging", "async"])
            if phase_failed(correct):
                log("correctness failed: again with synchronous staging (plain loads, no cp.async)")
                self.run("correctness_sync", "correctness", ["--staging", "sync"])
        if "served" in self.only:
            self.run("served", "served")
        if "h2d" in self.only:
            self.run("h2d", "h2d")
        # The first row size's timings before the sanitizer: they carry the raw-vs-H2D target,
        # and the sanitizer is the first thing to cut when time runs short.
        if "timing" in self.only:
            self.run(f"timing_{TIMING_ORDER[0]}", "timing", ["--rows", str(TIMING_ORDER[0])])
        if "sanitizer" in self.only:
            self.sanitizer()
        if "timing" in self.only:
            for r in TIMING_ORDER[1:]:
                self.run(f"timing_{r}", "timing", ["--rows", str(r)])
            # The huge-page A/B: c10 then backs large host allocations with 2 MB pages.
            self.run(
                "timing_512_thp",
                "timing",
                ["--rows", "512", "--variant", "thp"],
                env={"THP_MEM_ALLOC_ENABLE": "1"},
            )

    def finish(self) -> int:
        phases = self.report["phases"]
        rows = [row for p in phases.values() for row in p.get("results", [])]
        h2d = phases.get("h2d", {}).get("h2d_gbps")
        base = [row for row in rows if row.get("variant", "base") == "base"]
        self.report["targets"] = summarise(base, h2d)
        self.report["sort_rule"] = sort_rule(base)
        # The huge-page rows get their GB/s columns too (their targets are the base rows').
        summarise([row for row in rows if row.get("variant") == "thp"], h2d)
        self.report["results"] = rows
        print_table(rows, h2d)
        log("\ntargets (measured, not asserted):" + ("" if self.report["targets"] else " none"))
        for name, result in self.report["targets"].items():
            misses = ", ".join(result["misses"])
            log(f"  {name}: {'met' if result['met'] else 'MISSED at ' + misses}")
        # A correctness failure stays a failure when the sync-staging rerun passes: that rerun
        # only says where to look (cp.async or the decode).
        bad = [key for key, p in phases.items() if phase_failed(p)]
        self.report["failed_phases"] = bad
        self.save()
        log(f"\nwrote {self.out}; failed phases: {bad or 'none'}")
        return 1 if bad else 0


def phase_failed(result: dict[str, Any]) -> bool:
    checks = result.get("checks") or {}
    # A child's non-zero exit counts too: compute-sanitizer's --error-exitcode says so.
    return bool(
        result.get("fault")
        or result.get("error")
        or result.get("failures")
        or checks.get("failures")
        or result.get("rc") not in (None, 0)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path ($OUT/gpu_check.json)")
    parser.add_argument("--table-gib", type=float, default=8.0, help="raw GiB per row size")
    parser.add_argument("--zipf", default="1.2", help="comma-separated Zipf exponents")
    parser.add_argument(
        "--profile", choices=("dlrm", "dlrm-bf16"), default="dlrm", help="values of the big tables"
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU: toy sizes, CPU only")
    parser.add_argument(
        "--deadline-s", type=float, default=480.0, help="stop starting phases past this"
    )
    parser.add_argument("--skip-build", action="store_true", help="use the extension built last")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated phases to run, of {','.join(DRIVER_PHASES)} (default: all)",
    )
    # One phase in this process (what the driver runs in its children).
    parser.add_argument("--phase", choices=tuple(EXPECTED_S), help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="base", help=argparse.SUPPRESS)
    parser.add_argument(
        "--staging", choices=("async", "sync"), default="async", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--pin", choices=("register", "copy"), default="register", help=argparse.SUPPRESS
    )
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-extension", action="store_true", help=argparse.SUPPRESS)
    # Makes that phase fail as a CUDA fault does: how --dry-run reaches the fallback branches.
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on a CPU")
    if args.phase is not None:
        if args.phase == "sanitizer":  # the tiny correctness cases, under compute-sanitizer
            args.phase, args.tiny = "correctness", True
        return run_phase(args)
    out = args.out or Path(os.environ.get("OUT", CACHE)) / "gpu_check.json"
    return Driver(args, out, gpu).drive()


if __name__ == "__main__":
    sys.exit(main())
