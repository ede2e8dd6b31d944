# SPDX-License-Identifier: Apache-2.0
"""Train a small torchrec model on the real MovieLens-100k ratings and cache its tables.

The trained ``EmbeddingBagCollection`` tables (user_id, item_id) are the closest thing to a DLRM
checkpoint available offline: real ids, real popularity skew, real optimiser updates. Runs on
one CPU core in seconds to a few minutes (depending on how busy the host is); the tables are
cached under ``benchmarks/.cache/`` (gitignored).

    python -m benchmarks.train_movielens [--dim 32] [--epochs 12] [--force]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.data import movielens_interactions

CACHE_DIR = Path(__file__).resolve().parent / ".cache"
FEATURES = ("user_id", "item_id")


class RatingModel(nn.Module):
    """Two pooled id features -> embedding interaction -> MLP -> rating (DLRM-style, tiny)."""

    def __init__(self, num_users: int, num_items: int, dim: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        configs = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=dim,
                num_embeddings=rows,
                feature_names=[name],
                pooling=PoolingType.SUM,
            )
            for name, rows in zip(FEATURES, (num_users, num_items), strict=True)
        ]
        self.ebc = EmbeddingBagCollection(tables=configs)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Predicted ratings [B] for (user, item) pairs [B]."""
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(
            keys=list(FEATURES),
            values=torch.cat([users, items]),
            lengths=torch.ones(2 * users.numel(), dtype=torch.int64),
        )
        pooled = self.ebc(kjt).to_dict()
        u, i = pooled["user_id"], pooled["item_id"]
        return self.mlp(torch.cat([u, i, u * i], dim=1)).squeeze(1)


def train(
    *, dim: int = 32, epochs: int = 12, batch_size: int = 512, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Train on a random 80 % of the ratings; returns (tables, {"test_rmse", "train_seconds"})."""
    torch.manual_seed(seed)
    data = torch.from_numpy(movielens_interactions())
    users, items, ratings = data[:, 0], data[:, 1], data[:, 2].float()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(data))
    train_idx, test_idx = perm[:split], perm[split:]
    # Ids are 1-based: row 0 is never looked up and keeps its init, like real padding rows.
    model = RatingModel(int(users.max()) + 1, int(items.max()) + 1, dim)
    # Dense Adam: the tables are tiny, and it reached a lower test RMSE than Adagrad here.
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    mean = ratings[train_idx].mean()
    start = time.perf_counter()
    # One thread: the model is tiny, and on a busy host a second OpenMP worker that spins while
    # descheduled slows every step down by an order of magnitude.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(epochs):
            order = train_idx[torch.randperm(split)]
            for b in range(0, split, batch_size):
                idx = order[b : b + batch_size]
                pred = model(users[idx], items[idx]) + mean
                loss = nn.functional.mse_loss(pred, ratings[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        pred = model(users[test_idx], items[test_idx]) + mean
        rmse = float(torch.sqrt(nn.functional.mse_loss(pred, ratings[test_idx])))
    tables = {
        name: model.ebc.embedding_bags[name].weight.detach().clone().contiguous()
        for name in FEATURES
    }
    return tables, {"test_rmse": rmse, "train_seconds": elapsed}


def cache_path(dim: int, seed: int) -> Path:
    return CACHE_DIR / f"movielens100k_d{dim}_seed{seed}.pt"


def load_or_train(
    *, dim: int = 32, seed: int = 0, epochs: int = 12, force: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The cached trained tables, training them first if the cache is missing (or ``force``)."""
    path = cache_path(dim, seed)
    if path.is_file() and not force:
        saved = torch.load(path, weights_only=True)
        return saved["tables"], saved["info"]
    tables, info = train(dim=dim, epochs=epochs, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tables": tables, "info": info}, path)
    return tables, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--force", action="store_true", help="retrain even if cached")
    args = parser.parse_args()
    tables, info = load_or_train(dim=args.dim, seed=args.seed, epochs=args.epochs, force=args.force)
    shapes = {name: tuple(t.shape) for name, t in tables.items()}
    print(
        f"tables {shapes}; test RMSE {info['test_rmse']:.3f}; "
        f"trained in {info['train_seconds']:.1f} s -> {cache_path(args.dim, args.seed)}"
    )


if __name__ == "__main__":
    main()
