# SPDX-License-Identifier: Apache-2.0
"""Integrations benchmark: the Triton model vs ``ibpembed serve`` vs in-process, and the remote
torchrec EBC vs the in-process compressed EBC vs torchrec's EBC.

    python -m benchmarks.integrations [--quick] [--out DIR] [--seconds S]

One table set (the 26 DLRM-DCNv2-profile demo tables, D=128, cardinalities capped at
``max_rows``) serves every path in one run:

* **lookups** (SUM pooling, DCNv2 pooling factors, Zipf ids, B in {1, 64, 512} x 26 features):
  a real ``tritonserver`` (nvidia-pytriton's, the ``ibpembed triton-repo`` model) driven by
  tritonclient HTTP; ``ibpembed serve`` driven by the sync gRPC client; the ``LookupEngine``
  called in-process;
* **torchrec modules** (B in {64, 512}): ``RemoteEmbeddingBagCollection`` against the same
  ``ibpembed serve``, ``CompressedEmbeddingBagCollection`` over the same table files, and
  torchrec's ``EmbeddingBagCollection`` holding the same rows decompressed.

Every path runs one request at a time (closed loop, one client thread): QPS is 1 / mean latency,
p50 and p99 are per request, so the paths compare on the same footing on a shared machine. The
servers run one worker and one torch thread, as does this process. No decoded tier anywhere
(so every path decodes the same rows). Results: DIR/integrations.json and DIR/integrations.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import RESULTS, run_metadata, settings, write_results
from ibpembed.codec import compress
from ibpembed.engine import LookupEngine
from ibpembed.server import demo
from ibpembed.server.wire import decode_request
from ibpembed.tables.pack import save_table_set
from ibpembed.tables.store import TableStore
from ibpembed.triton.repo import write_repository
from ibpembed_client import LookupClient
from ibpembed_client.workload import DCNV2_CARDINALITIES, hotness_for, make_requests
from tools.serve_process import ServerProcess
from tools.triton_process import TritonProcess

LOOKUP_BATCHES = (1, 64, 512)
MODULE_BATCHES = (64, 512)


@dataclass(frozen=True)
class Config:
    max_rows: int
    seconds: float  # measured per point and path
    warmup_s: float
    requests: int  # distinct requests cycled through per point


FULL = Config(max_rows=20_000, seconds=3.0, warmup_s=0.5, requests=4)
QUICK = Config(max_rows=2_000, seconds=0.3, warmup_s=0.1, requests=2)


def pack(directory: Path, max_rows: int) -> dict[str, int]:
    """The demo tables into ``directory``; returns rows per feature."""
    tables, features = {}, {}
    for i, name in enumerate(demo.feature_names()):
        rows = min(DCNV2_CARDINALITIES[i], max_rows)
        raw = demo.demo_table(rows, demo.DIM, i, bf16_rounded=i % 4 == 3)
        tables[name] = compress(raw, sample_rows=min(rows, 4096))
        features[name] = name
    save_table_set(directory, tables, features, pooling=dict.fromkeys(features, "sum"))
    return {name: t.num_rows for name, t in tables.items()}


def timed(call: Callable[[int], object], seconds: float, warmup_s: float) -> dict:
    """Run ``call(i)`` back to back; per-call latency after ``warmup_s``."""
    latencies: list[float] = []
    start = time.perf_counter()
    warm_from, stop_at = start + warmup_s, start + warmup_s + seconds
    i = 0
    while (now := time.perf_counter()) < stop_at:
        call(i)
        if now >= warm_from:
            latencies.append(time.perf_counter() - now)
        i += 1
    lat = np.asarray(latencies) * 1000.0
    return {
        "qps": 1000.0 / float(lat.mean()),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "calls": int(lat.size),
    }


def triton_call(client, decoded: list) -> Callable[[int], object]:
    import tritonclient.http as http

    prepared = []
    for features, _ in decoded:
        inputs = []
        for q in features:
            for suffix, array, dtype in (("ids", q.ids, "INT64"), ("lengths", q.lengths, "INT32")):
                item = http.InferInput(f"{q.name}__{suffix}", [array.size], dtype)
                item.set_data_from_numpy(np.ascontiguousarray(array), binary_data=True)
                inputs.append(item)
        outputs = [http.InferRequestedOutput(f"{q.name}__pooled") for q in features]
        prepared.append((inputs, outputs))

    def call(i: int) -> object:
        inputs, outputs = prepared[i % len(prepared)]
        result = client.infer("ibpembed", inputs, outputs=outputs)
        return [result.as_numpy(o.name()) for o in outputs]

    return call


def to_kjt(features: list):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=[q.name for q in features],
        values=torch.from_numpy(np.concatenate([q.ids for q in features])),
        lengths=torch.from_numpy(np.concatenate([q.lengths for q in features]).astype(np.int64)),
    )


def run(cfg: Config, out: Path, command: str) -> dict:
    torch.set_num_threads(1)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from ibpembed.torchrec import CompressedEmbeddingBagCollection, RemoteEmbeddingBagCollection

    lookups, modules = [], []
    one_thread = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ibpembed-bench-") as tmp:
        tables = Path(tmp) / "tables"
        rows = pack(tables, cfg.max_rows)
        features = list(rows)
        write_repository(tables, Path(tmp) / "repo")
        triton = TritonProcess(Path(tmp) / "repo", wait=False, env=one_thread)
        server = ServerProcess(
            *("--tables", str(tables), "--workers", "1", "--torch-threads", "1"),
            *("--device", "cpu", "--hot-tier", "off", "--log-level", "warning"),
            env=one_thread,
        )
        store = TableStore.load(tables)
        engine = LookupEngine(store, max_workers=1)
        try:
            triton.wait_ready()
            import tritonclient.http as http

            tclient = http.InferenceServerClient(triton.http, network_timeout=120.0)
            gclient = LookupClient(server.target, timeout=120.0)
            hotness = hotness_for(features, "dcnv2")
            for batch in LOOKUP_BATCHES:
                requests = make_requests(
                    rows,
                    batch_size=batch,
                    hotness=hotness,
                    alpha=1.05,
                    pooling="sum",
                    count=cfg.requests,
                )
                decoded = [decode_request(r) for r in requests]
                paths = {
                    "in-process engine": lambda i, d=decoded: engine.run(*d[i % len(d)]),
                    "ibpembed serve (gRPC)": lambda i, r=requests: gclient.lookup_request(
                        r[i % len(r)]
                    ),
                    "Triton (HTTP)": triton_call(tclient, decoded),
                }
                # Every path answers the same request with the same bits before timing.
                want = engine.run(*decoded[0]).features
                got_triton = paths["Triton (HTTP)"](0)
                got_grpc = gclient.lookup_request(requests[0])
                for k, f in enumerate(want):
                    assert got_triton[k].tobytes() == f.values.numpy().tobytes()
                    assert got_grpc[f.name].tobytes() == f.values.numpy().tobytes()
                for name, call in paths.items():
                    row = {"batch": batch, "features": len(features), "path": name}
                    row |= timed(call, cfg.seconds, cfg.warmup_s)
                    lookups.append(row)
                    print(json.dumps(row), flush=True)
            # torchrec modules over the same rows.
            configs = [
                EmbeddingBagConfig(
                    name=f, embedding_dim=demo.DIM, num_embeddings=rows[f], feature_names=[f]
                )
                for f in features
            ]
            ebc = EmbeddingBagCollection(tables=configs)
            with store.acquire() as snap, torch.no_grad():
                for f in features:
                    dense = snap.tables[f].decompress()
                    ebc.embedding_bags[f].weight.copy_(dense.view(torch.float32))
            local = CompressedEmbeddingBagCollection.from_table_set(tables, tables=features)
            remote = RemoteEmbeddingBagCollection.from_server(server.target, features)
            for batch in MODULE_BATCHES:
                requests = make_requests(
                    rows,
                    batch_size=batch,
                    hotness=hotness,
                    alpha=1.05,
                    pooling="sum",
                    count=cfg.requests,
                    seed=1,
                )
                kjts = [to_kjt(decode_request(r)[0]) for r in requests]
                with torch.no_grad():
                    assert torch.equal(remote(kjts[0]).values(), local(kjts[0]).values())
                    for name, module in (
                        ("RemoteEmbeddingBagCollection", remote),
                        ("CompressedEmbeddingBagCollection", local),
                        ("torchrec EmbeddingBagCollection", ebc),
                    ):
                        row = {"batch": batch, "features": len(features), "module": name}
                        row |= timed(
                            lambda i, m=module, k=kjts: m(k[i % len(k)]), cfg.seconds, cfg.warmup_s
                        )
                        modules.append(row)
                        print(json.dumps(row), flush=True)
            remote.close()
            gclient.close()
            tclient.close()
        finally:
            server.stop()
            triton.stop()
            engine.close()
    report = {
        **run_metadata(command),
        "config": cfg.__dict__,
        "lookups": lookups,
        "modules": modules,
    }
    write_results(out, "integrations", report, markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [
        f"{report['date']}, {report['machine']}, torch {report['torch']}, "
        f"`{report['command']}` ({settings(report['config'])}); one request at a time",
        "",
        "| B | features | path | QPS | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["lookups"]:
        lines.append(
            f"| {r['batch']} | {r['features']} | {r['path']} | {r['qps']:.1f} "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
        )
    lines += [
        "",
        "| B | features | module | forwards/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["modules"]:
        lines.append(
            f"| {r['batch']} | {r['features']} | {r['module']} | {r['qps']:.1f} "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, short points")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per point")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.seconds is not None:
        cfg = Config(cfg.max_rows, args.seconds, cfg.warmup_s, cfg.requests)
    given = sys.argv[1:] if argv is None else argv
    report = run(cfg, args.out, " ".join(["python -m benchmarks.integrations", *given]))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
