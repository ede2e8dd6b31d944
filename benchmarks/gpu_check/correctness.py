# SPDX-License-Identifier: Apache-2.0
"""Phase ``correctness``: the CUDA ops against the CPU ops on the same small tables, gather and
decompress bit for bit for every dtype (fp32/fp16/bf16/uint8/int8, fbgemm row-wise int8), edge
rows (NaN payloads, inf, -0.0, subnormals, raw rows, D = 1, D = 129), every chunk width and slot
alignment, unsorted and duplicate ids, the payload registered in place (as the server places
it), pinned and on the GPU; pooled SUM/MEAN with and without weights equal to the CPU bit for
bit (NaN payloads aside); bad ids and offsets raise like the CPU ops. ``tiny``: four cases, what
the compute-sanitizer runs.

On the CPU (--dry-run) the CPU ops against independent answers instead: gathers against the
source rows, pooled lookups against ``ibpembed.reference``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_check.common import (
    STAGING_ENV,
    Checks,
    CudaFault,
    is_cuda_fault,
    log,
    same_bits,
    sort_min_ids,
)
from tools.device_args import device_args

EDGE_BITS = {
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF, 0x7F800001,
        0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F800000],
    2: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFDFF, 0x0001, 0x83FF, 0x7BFF, 0x7F80, 0xFF81],
    1: [0x00, 0x80, 0xFF, 0x7F, 0x01],
}  # fmt: skip


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
        want = ops.ibp_gather(*c.op_args(), ids)
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
        check_pooled(ops, c, c.dtype_code, rng, checks, label, dev, values)


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
    from ibpembed.layout import POOLING_CODES

    lengths = rng.integers(0, 40, 200)
    lengths[::9] = 0  # empty bags
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, c.num_rows, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    args = device_args(c, dev)
    for pooling in ("sum", "mean"):
        for w in (None, weights):
            if values is not None:
                got = ops.lookup_pooled(*args, ids, offsets, w, dtype_code, POOLING_CODES[pooling])
                ok = matches_reference(got, values, ids, offsets, w, pooling)
                checks.record(ok, f"pooled {pooling} weighted={w is not None} {label} (reference)")
                continue
            want = ops.lookup_pooled(
                *c.op_args(), ids, offsets, w, dtype_code, POOLING_CODES[pooling]
            )
            got = ops.lookup_pooled(
                *args,
                ids.to(dev),
                offsets.to(dev),
                None if w is None else w.to(dev),
                dtype_code,
                POOLING_CODES[pooling],
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

        # A pageable copy: ``args`` keeps c.payload itself registered (page-locked) in place.
        pageable = dataclasses.replace(c, payload=c.payload.clone())
        host_args = device_args(pageable, dev, where="host")
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
