# SPDX-License-Identifier: Apache-2.0
"""Forward time, host bytes and accuracy: compressed EBC vs torchrec's EBC vs its INT8 EBC.

    python -m benchmarks.torchrec_module [--quick] [--out DIR]   # both models

Results go to DIR/torchrec_module.json and DIR/torchrec_module.md (``--quick``: small tables,
few batches, a smoke run).

Two models, each run on the same Zipf batches (B=512, alpha 1.0, hot ids permuted):

- ``movielens``: torchrec's DLRM trained on real MovieLens-100k (examples/movielens_dlrm.py); the
  whole model's forward is timed, and accuracy is the test AUC and logit deltas on real ratings.
- ``synthetic``: a DLRM-profile EmbeddingBagCollection alone (D=128, pooling factors 1 to 32),
  tables drawn trained-like (per-column scales from 1e-3 to 1e-1) in two variants: full fp32
  mantissas, and bf16-rounded values stored as fp32 (checkpoints trained in bf16).

Accuracy is reported against the float EBC: ours is lossless (rows bit-exact, pooled within the
fp32 summation bound), INT8 is measured. Timings are medians over batches of each batch's best of
a few passes that run the modules side by side (see ``interleaved_ms``), with the interquartile
range, on whatever CPU runs this (the header records it).
"""

import argparse
import copy
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.ao.quantization as tq
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

import ibpembed
from benchmarks._harness import RESULTS, run_metadata, write_results
from ibpembed.torchrec import CompressedEmbeddingBagCollection, pooled_error_bound

BATCH = 512
# Batches that rank the hot rows: drawn like the timed ones, never the timed ones themselves.
TRAFFIC_SEED = 10_000
HOT_LABEL = "ibpembed compressed + hot rows"
SAVINGS_LABEL = "ibpembed compressed + tier savings"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "movielens_dlrm.py"


def zipf_ids(
    num_rows: int, n: int, alpha: float, gen: torch.Generator, table_seed: int
) -> torch.Tensor:
    """``n`` ids with P(rank k) ~ 1 / k^alpha, ranks mapped to rows by a permutation fixed per
    table (``table_seed``): the same rows are hot in every batch, as in real traffic."""
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    picks = torch.multinomial(ranks.pow(-alpha), n, replacement=True, generator=gen)
    hot = torch.randperm(num_rows, generator=torch.Generator().manual_seed(table_seed))
    return hot[picks]


def zipf_kjt(
    configs: list[EmbeddingBagConfig], pooling_factors: dict[str, int], alpha: float, seed: int
) -> KeyedJaggedTensor:
    """One batch of B=512 bags per feature; bag lengths uniform in [1, 2 * pooling factor - 1]."""
    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t, c in enumerate(configs):
        for f in c.feature_names:
            pf = pooling_factors[f]
            lens = torch.randint(
                max(1, 2 * pf - 1) if pf == 1 else 1, 2 * pf, (BATCH,), generator=gen
            )
            keys.append(f)
            lengths.append(lens)
            values.append(zipf_ids(c.num_embeddings, int(lens.sum()), alpha, gen, 1000 + t))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def quantize_int8(ebc: EmbeddingBagCollection) -> QuantEmbeddingBagCollection:
    """torchrec's own INT8 inference EBC (row-wise int8, fp16 scale and bias per row)."""
    # from_float reads the qconfig off the float module: set it only for the call.
    ebc.qconfig = tq.QConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
        weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    try:
        return QuantEmbeddingBagCollection.from_float(ebc)
    finally:
        del ebc.qconfig


def host_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    storages = {}
    for t in module.state_dict().values():
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def interleaved_ms(
    fns: Sequence[Callable[[int], object]], batches: int, warmup: int, passes: int
) -> list[tuple[float, float]]:
    """Per function: the median and interquartile range over batches of fn(i)'s best time over
    ``passes`` passes, in ms.

    The functions are timed side by side: each pass runs batch after batch, every function on a
    batch in turn (starting with another one each time), so no function runs a batch again with
    the caches it has just warmed, and a noisy moment on the shared CPUs lands on all of them.
    Best of the passes because other processes only ever add time.
    """
    for i in range(warmup):
        for fn in fns:
            fn(i % batches)
    best = [[float("inf")] * batches for _ in fns]
    for p in range(passes):
        for i in range(batches):
            for j in range(len(fns)):
                k = (i + p + j) % len(fns)
                start = time.perf_counter()
                fns[k](i)
                best[k][i] = min(best[k][i], time.perf_counter() - start)
    out = []
    for times in best:
        ms = [t * 1e3 for t in times]
        q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        out.append((statistics.median(ms), q[2] - q[0]))
    return out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over the whole batch."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def compressed_bytes(module: CompressedEmbeddingBagCollection) -> int:
    """Host bytes of a compressed collection, its decoded tier included."""
    return sum(t.stored_bytes + t.hot_bytes for t in module.table_bytes())


def compressed_variants(
    ebc: EmbeddingBagCollection, traffic: list[KeyedJaggedTensor]
) -> list[tuple[str, CompressedEmbeddingBagCollection]]:
    """The compressed module as built, and with a decoded tier ranked on earlier ``traffic``:
    the server's default budget (``ibpembed.engine.tier``), and the largest that keeps each
    table within its raw bytes."""
    hot = CompressedEmbeddingBagCollection.from_ebc(ebc)
    hot.cache_hot_rows(traffic)
    savings = CompressedEmbeddingBagCollection.from_ebc(ebc)
    savings.cache_hot_rows(traffic, budget="savings")
    return [
        ("ibpembed compressed", CompressedEmbeddingBagCollection.from_ebc(ebc)),
        (HOT_LABEL, hot),
        (SAVINGS_LABEL, savings),
    ]


def compare_ebcs(
    name: str,
    ebc: EmbeddingBagCollection,
    kjts: list[KeyedJaggedTensor],
    traffic: list[KeyedJaggedTensor],
    warmup: int,
    passes: int,
) -> list[dict[str, object]]:
    """Forward time, host bytes and pooled accuracy of the modules on the same batches."""
    reference = [ebc(k).values().detach() for k in kjts]
    int8 = quantize_int8(ebc)
    modules = [
        ("torchrec EBC fp32", ebc, host_bytes(ebc)),
        ("torchrec INT8 EBC", int8, host_bytes(int8)),
        *((label, m, compressed_bytes(m)) for label, m in compressed_variants(ebc, traffic)),
    ]
    with torch.no_grad():
        timings = interleaved_ms(
            [lambda i, m=module: m(kjts[i]) for _, module, _ in modules],
            len(kjts),
            warmup,
            passes,
        )
    rows = []
    for (label, module, nbytes), (ms, iqr) in zip(modules, timings, strict=True):
        with torch.no_grad():
            outputs = [module(k).values() for k in kjts]
        err = max(relative_error(o, r) for o, r in zip(outputs, reference, strict=True))
        delta = max(float((o - r).abs().max()) for o, r in zip(outputs, reference, strict=True))
        within = all(
            bool(((o.double() - r.double()).abs() <= pooled_error_bound(ebc, k)).all())
            for o, r, k in zip(outputs, reference, kjts, strict=True)
        )
        rows.append(
            {"model": name, "module": label, "ms": ms, "iqr": iqr, "bytes": nbytes,
             "rel_err": err, "max_abs": delta, "within_bound": within}
        )  # fmt: skip
    return rows


def synthetic_ebc(num_rows: int, bf16_rounded: bool, seed: int) -> EmbeddingBagCollection:
    """Four D=128 tables; columns N(0, s_j) with s_j log-spaced over [1e-3, 1e-1]."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=num_rows,
                           feature_names=[f"f{i}"], pooling=PoolingType.SUM)
        for i in range(4)
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=tables)
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            scales = torch.logspace(-3, -1, 128)[torch.randperm(128)]
            w = torch.randn(num_rows, 128) * scales
            bag.weight.copy_(w.bfloat16().float() if bf16_rounded else w)
    return ebc


def with_ebc(model: torch.nn.Module, ebc: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of the DLRM ``model`` whose sparse arch reads ``ebc``; the original and
    its other submodules are shared, not changed."""
    sparse = copy.copy(model.sparse_arch)
    sparse._modules = dict(sparse._modules)  # a shallow copy would share (and edit) the dict
    sparse.embedding_bag_collection = ebc
    copied = copy.copy(model)
    copied._modules = dict(copied._modules)
    copied.sparse_arch = sparse
    return copied


def run_movielens(args: argparse.Namespace) -> list[dict[str, object]]:
    """Trained DLRM: whole-model forward on Zipf batches, accuracy on the real test ratings."""
    spec = importlib.util.spec_from_file_location("movielens_dlrm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = example.MovieLens(limit=5000 if args.quick else None)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    test_idx, train_idx = order[: len(data) // 10], order[len(data) // 10 :]
    model = example.make_model(data, 16, seed=0)
    example.train(model, data, train_idx, epochs=1 if args.quick else 3, batch=1024)
    ebc = model.sparse_arch.embedding_bag_collection
    configs = ebc.embedding_bag_configs()
    factors = {k: 1 for k in example.SPARSE_KEYS} | {"genre": 3}
    kjts = [zipf_kjt(configs, factors, args.alpha, seed=s) for s in range(args.batches)]
    traffic = [zipf_kjt(configs, factors, args.alpha, seed=TRAFFIC_SEED + s) for s in range(8)]
    gen = torch.Generator().manual_seed(1)
    dense = [data.dense[torch.randint(0, len(data), (BATCH,), generator=gen)] for _ in kjts]
    test_dense, test_kjt, labels = data.batch(test_idx)
    variants = [
        ("torchrec EBC fp32", ebc),
        ("torchrec INT8 EBC", quantize_int8(ebc)),
        *compressed_variants(ebc, traffic),
    ]
    # One model per module, sharing the dense layers, so that switching modules between timed
    # calls costs nothing.
    models = [with_ebc(model, module) for _, module in variants]
    rows = []
    with torch.no_grad():
        ref_logits = model(test_dense, test_kjt).squeeze(1)
        timings = interleaved_ms(
            [lambda i, m=m: m(dense[i], kjts[i]) for m in models],
            len(kjts),
            args.warmup,
            args.passes,
        )
        for (label, module), copied, (ms, iqr) in zip(variants, models, timings, strict=True):
            logits = copied(test_dense, test_kjt).squeeze(1)
            nbytes = (
                compressed_bytes(module)
                if isinstance(module, CompressedEmbeddingBagCollection)
                else host_bytes(module)
            )
            rows.append(
                {"model": "movielens DLRM (whole forward)", "module": label, "ms": ms,
                 "iqr": iqr, "bytes": nbytes,
                 "auc": example.auc(logits, labels),
                 "max_abs": float((logits - ref_logits).abs().max())}
            )  # fmt: skip
    return rows


def markdown(ml: list[dict[str, object]], syn: list[dict[str, object]], args) -> str:
    """The BENCHMARKS.md section."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux names the model; platform only gives the architecture
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    out = [
        "## torchrec integration: compressed EBC vs torchrec EBC vs torchrec INT8 EBC",
        "",
        f"`python -m benchmarks.torchrec_module{' --quick' if args.quick else ''}"
        f"{f' --threads {args.threads}' if args.threads != 1 else ''}` "
        f"({time.strftime('%Y-%m-%d')}; {cpu}, {os.cpu_count()} cores, "
        f"torch threads: {torch.get_num_threads()}; torch {torch.__version__}; "
        f"ibpembed CPU path `{ibpembed.cpu_path()}`). Same Zipf batches (B={BATCH}, "
        f"alpha {args.alpha}, hot ids permuted) for every module, the modules timed side by "
        f"side: {args.passes} passes over the batches, each batch run by every module in turn "
        "(rotating which goes first); per batch the best of the passes (shared CPUs), then the "
        f"median over {args.batches} batches after {args.warmup} warm-up, IQR in brackets. "
        "Each table's hot ids are the same in every "
        f"batch. *{HOT_LABEL}*: `cache_hot_rows` on 8 other batches of the same "
        f"distribution (1 % of raw bytes per table); *{SAVINGS_LABEL}*: the same with "
        '`budget="savings"` (the largest tier that keeps each table within its raw bytes); '
        "host bytes include the tier.",
        "",
        "MovieLens-100k DLRM (real trained tables, 6 features, D=16). Time is the whole model's "
        "forward; accuracy is on the 10 % held-out real ratings.",
        "",
        "| module | forward ms [IQR] | table host bytes | test AUC | max abs logit delta |",
        "|---|---|---|---|---|",
    ]
    for r in ml:
        out.append(
            f"| {r['module']} | {r['ms']:.2f} [{r['iqr']:.2f}] | {r['bytes']:,} | "
            f"{r['auc']:.4f} | {r['max_abs']:.2g} |"
        )
    out += [
        "",
        f"DLRM-profile EmbeddingBagCollection alone: 4 tables x {args.rows:,} rows x D=128 "
        "(pooling factors 1, 4, 16, 32), trained-like values. Accuracy vs the fp32 EBC over all "
        "batches: worst relative L2 error of the pooled batch, worst abs element delta, and "
        "whether every element lies within ibpembed's fp32 summation bound.",
        "",
        "| tables | module | forward ms [IQR] | host bytes | vs fp32 | rel. L2 err | max abs delta "
        "| within fp32 bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in syn:
        base = next(b for b in syn if b["model"] == r["model"])["bytes"]
        out.append(
            f"| {r['model']} | {r['module']} | {r['ms']:.2f} [{r['iqr']:.2f}] | "
            f"{r['bytes']:,} | {r['bytes'] / base:.1%} | {r['rel_err']:.2g} | "
            f"{r['max_abs']:.2g} | {'yes' if r['within_bound'] else 'no'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small tables, few batches")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per synthetic table")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5, help="timed passes (best kept per batch)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: stable on shared CPUs)"
    )
    parser.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batches, args.warmup = 5_000, 4, 1
    # NOTE: with several threads on CPUs shared with other jobs, a parallel_for waits for its
    # slowest, descheduled thread and the timings become noise; one thread for every module.
    torch.set_num_threads(args.threads)
    ml = run_movielens(args)
    syn = []
    factors = {"f0": 1, "f1": 4, "f2": 16, "f3": 32}
    for bf16 in (False, True):
        ebc = synthetic_ebc(args.rows, bf16_rounded=bf16, seed=0)
        configs = ebc.embedding_bag_configs()
        kjts = [zipf_kjt(configs, factors, args.alpha, seed=s) for s in range(args.batches)]
        traffic = [zipf_kjt(configs, factors, args.alpha, seed=TRAFFIC_SEED + s) for s in range(8)]
        name = "bf16-rounded fp32" if bf16 else "full fp32"
        syn += compare_ebcs(name, ebc, kjts, traffic, args.warmup, args.passes)
        del ebc
    text = markdown(ml, syn, args)
    print(text)
    command = "python -m benchmarks.torchrec_module " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    result = {**run_metadata(command.strip()), "movielens": ml, "synthetic": syn}
    write_results(args.out, "torchrec_module", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
