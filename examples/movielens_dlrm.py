# SPDX-License-Identifier: Apache-2.0
"""Train a small DLRM on real MovieLens-100k, swap its tables for compressed ones, compare.

    python examples/movielens_dlrm.py          # 100k ratings, 3 epochs (about a minute, 2 cores)
    python examples/movielens_dlrm.py --quick  # 5k-rating slice, 1 epoch (what the test runs)

The data ships in the ``recbole`` wheel (``pip install --no-deps recbole==1.2.1``); nothing is
downloaded. The model is torchrec's own ``DLRM`` predicting "rating >= 4" from six sparse features
(user, item, occupation, gender, age bucket and the item's genres as a multi-id MEAN-pooled bag)
and three dense ones. After training, ``ibpembed.torchrec.compress_model`` swaps the model's
``EmbeddingBagCollection`` for a ``CompressedEmbeddingBagCollection`` and the script checks:

- every table row decodes bit-exact;
- every pooled embedding is within ``pooled_error_bound`` (the fp32 summation bound) of torchrec's;
- the model's predictions, and so its test AUC, are unchanged (bitwise whenever the pooled
  embeddings are, since the dense layers see identical inputs);

and prints the host bytes per table before and after. Exits non-zero if a check fails.
"""

import argparse
import csv
import importlib.util
import sys
import time
from pathlib import Path

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM

from ibpembed.torchrec import compress_model, format_table_bytes, pooled_error_bound

SPARSE_KEYS = ["user_id", "item_id", "occupation", "gender", "age", "genre"]
DENSE_FEATURES = 3  # user age, movie release year, rating time; each scaled to about [0, 1]


def data_dir() -> Path:
    """MovieLens-100k inside the installed recbole wheel; raises if recbole is missing."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("MovieLens-100k ships in recbole: pip install --no-deps recbole")
    return Path(spec.submodule_search_locations[0]) / "dataset_example" / "ml-100k"


def _read(path: Path) -> list[dict[str, str]]:
    # Atomic files: tab-separated, header "name:type"; titles contain spaces but never tabs.
    with path.open(newline="", encoding="latin-1") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    names = [h.split(":")[0] for h in rows[0]]
    return [dict(zip(names, r, strict=False)) for r in rows[1:] if r]


class MovieLens:
    """MovieLens-100k ratings as DLRM inputs: dense [n, 3], sparse ids, labels [n].

    Parameters
    ----------
    limit : keep only the first ``limit`` ratings of the file (the ``--quick`` slice).
    """

    def __init__(self, limit: int | None = None) -> None:
        root = data_dir()
        inter = _read(root / "ml-100k.inter")[:limit]
        users = {int(u["user_id"]): u for u in _read(root / "ml-100k.user")}
        items = {int(i["item_id"]): i for i in _read(root / "ml-100k.item")}
        occupations = sorted({u["occupation"] for u in users.values()})
        genders = sorted({u["gender"] for u in users.values()})
        genres = sorted({g for i in items.values() for g in i.get("class", "").split()})
        # Raw ids index the tables directly (row 0 unused): the tables are real trained rows
        # addressed exactly as MovieLens numbers them.
        self.num_rows = {
            "user_id": max(users) + 1,
            "item_id": max(items) + 1,
            "occupation": len(occupations),
            "gender": len(genders),
            "age": 10,
            "genre": len(genres),
        }
        user = torch.tensor([int(r["user_id"]) for r in inter])
        item = torch.tensor([int(r["item_id"]) for r in inter])
        self.sparse = {
            "user_id": user,
            "item_id": item,
            "occupation": torch.tensor(
                [occupations.index(users[int(u)]["occupation"]) for u in user]
            ),
            "gender": torch.tensor([genders.index(users[int(u)]["gender"]) for u in user]),
            "age": torch.tensor([min(int(users[int(u)]["age"]) // 10, 9) for u in user]),
        }
        # Genres: a bag per movie, stored as CSR over item ids.
        bags = [[genres.index(g) for g in items[i]["class"].split()] if i in items else []
                for i in range(self.num_rows["item_id"])]  # fmt: skip
        self.genre_lengths = torch.tensor([len(b) for b in bags])
        self.genre_values = torch.tensor([g for b in bags for g in b])
        self.genre_offsets = torch.cat(
            [torch.zeros(1, dtype=torch.long), self.genre_lengths.cumsum(0)]
        )
        year = torch.tensor([_year(items[int(i)]) for i in item])
        stamp = torch.tensor([float(r["timestamp"]) for r in inter])
        self.dense = torch.stack(
            [
                torch.tensor([float(users[int(u)]["age"]) for u in user]) / 100,
                (year - 1920).clamp(min=0) / 80,
                (stamp - stamp.min()) / (stamp.max() - stamp.min()).clamp(min=1),
            ],
            dim=1,
        )
        self.labels = torch.tensor([float(r["rating"]) >= 4 for r in inter], dtype=torch.float32)

    def __len__(self) -> int:
        return self.labels.numel()

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """(dense [B, 3], KJT with the six sparse keys, labels [B]) for ratings ``idx``."""
        singles = [self.sparse[k][idx] for k in SPARSE_KEYS[:-1]]
        items = self.sparse["item_id"][idx]
        lengths = self.genre_lengths[items]
        # Gather each movie's genre bag: start of its bag + position inside it.
        starts = self.genre_offsets[items].repeat_interleave(lengths)
        within = torch.arange(int(lengths.sum())) - (lengths.cumsum(0) - lengths).repeat_interleave(
            lengths
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=SPARSE_KEYS,
            values=torch.cat([*singles, self.genre_values[starts + within]]),
            lengths=torch.cat([torch.ones(len(singles) * idx.numel(), dtype=torch.long), lengths]),
        )
        return self.dense[idx], kjt, self.labels[idx]


def _year(item: dict[str, str]) -> float:
    # A few movies have no release year (the file spells it "unkonwn"): use the oldest bucket.
    year = item.get("release_year", "")
    return float(year) if year.strip().isdigit() else 1920.0


def make_model(data: MovieLens, dim: int, seed: int) -> DLRM:
    """torchrec's DLRM over one EmbeddingBagCollection; the genre bag is MEAN-pooled."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=dim,
            num_embeddings=data.num_rows[key],
            feature_names=[key],
            pooling=PoolingType.MEAN if key == "genre" else PoolingType.SUM,
        )
        for key in SPARSE_KEYS
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=DENSE_FEATURES,
        dense_arch_layer_sizes=[32, dim],
        over_arch_layer_sizes=[64, 32, 1],
    )


def train(model: DLRM, data: MovieLens, train_idx: torch.Tensor, epochs: int, batch: int) -> None:
    """Adam on binary cross-entropy, shuffled mini-batches."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    for epoch in range(epochs):
        total = 0.0
        for idx in train_idx[torch.randperm(train_idx.numel())].split(batch):
            dense, kjt, labels = data.batch(idx)
            loss = loss_fn(model(dense, kjt).squeeze(1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        print(f"epoch {epoch + 1}: train logloss {total / train_idx.numel():.4f}")
    model.eval()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U; ties do not occur with float logits here)."""
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the example; returns the measured numbers (the test reads them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5k-rating slice, 1 epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dim", type=int, default=16, help="embedding dim of every table")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs

    start = time.perf_counter()
    data = MovieLens(limit=5000 if args.quick else None)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=gen)
    test_idx, train_idx = order[: len(data) // 10], order[len(data) // 10 :]
    print(
        f"MovieLens-100k: {len(data)} ratings ({train_idx.numel()} train / {test_idx.numel()} test)"
    )
    model = make_model(data, args.dim, args.seed)
    train(model, data, train_idx, epochs, args.batch)

    dense, kjt, labels = data.batch(test_idx)
    ebc = model.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        pooled_before = ebc(kjt).values()
        logits_before = model(dense, kjt).squeeze(1)
    weights = {
        c.name: ebc.embedding_bags[c.name].weight.detach().clone()
        for c in ebc.embedding_bag_configs()
    }

    report = compress_model(model)
    compressed = model.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        pooled_after = compressed(kjt).values()
        logits_after = model(dense, kjt).squeeze(1)

    rows_exact = all(
        torch.equal(compressed.embedding_bags[name].compressed_table().decompress().view(torch.int32),
                    w.view(torch.int32))
        for name, w in weights.items()
    )  # fmt: skip
    pooled_delta = (pooled_after.double() - pooled_before.double()).abs()
    bound = pooled_error_bound(ebc, kjt)
    within = bool((pooled_delta <= bound).all())
    results = {
        "auc_before": auc(logits_before, labels),
        "auc_after": auc(logits_after, labels),
        "pooled_max_abs_delta": float(pooled_delta.max()),
        "pooled_max_bound": float(bound.max()),
        "logit_max_abs_delta": float((logits_after - logits_before).abs().max()),
        "raw_bytes": float(sum(r.raw_bytes for r in report)),
        "stored_bytes": float(sum(r.stored_bytes for r in report)),
        "rows_bit_exact": float(rows_exact),
        "pooled_within_bound": float(within),
    }
    print()
    print(format_table_bytes(report))
    print()
    print(f"rows bit-exact:        {rows_exact}")
    print(
        f"pooled |delta| max:    {results['pooled_max_abs_delta']:.3g} (fp32 summation bound, "
        f"largest entry: {results['pooled_max_bound']:.3g}) -> within: {within}"
    )
    print(f"logit |delta| max:     {results['logit_max_abs_delta']:.3g}")
    print(f"test AUC before/after: {results['auc_before']:.4f} / {results['auc_after']:.4f}")
    saved = results["raw_bytes"] - results["stored_bytes"]
    print(f"host bytes saved:      {saved:,.0f} of {results['raw_bytes']:,.0f}")
    print(f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    # Pooled sums may differ within the fp32 bound, which moves logits by ~1e-6: ranks, and so
    # the AUC, stay put (one swapped pair of the ~10k test ratings moves it by ~1e-8).
    if not (rows_exact and within and abs(results["auc_after"] - results["auc_before"]) <= 1e-6):
        raise SystemExit("compressed model disagrees with the original")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
