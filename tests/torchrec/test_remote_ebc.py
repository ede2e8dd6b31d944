# SPDX-License-Identifier: Apache-2.0
"""RemoteEmbeddingBagCollection against a real ``ibpembed`` gRPC server on loopback.

The server and the in-process ``CompressedEmbeddingBagCollection`` read the same packed table
files and pool with the same kernel, so a whole-table server must match the in-process module
bit for bit. Row-sharded servers add partial sums in another order: they are held to the fp32
bound against torchrec's own module.
"""

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torchrec.modules.embedding_modules", reason="torchrec is not installed")

import torch
from torch import nn
from torchrec import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from ibpembed.cli import main as main_cli
from ibpembed.tables.importers import TableSet, TableSource, from_torchrec
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.shards import pack_shards
from ibpembed.tables.store import TableStore
from ibpembed.torchrec import (
    CompressedEmbeddingBagCollection,
    RemoteEmbeddingBagCollection,
    compress_model,
    pooled_error_bound,
)
from ibpembed.torchrec.remote import RemoteLookupError
from tests.engine.helpers import make_store
from tests.server.helpers import RunningServer

# Awkward dims (1, 3, 129), SUM and MEAN mixed, a table read by two features, an FP16 table.
TABLES = [
    EmbeddingBagConfig(name="t_small", embedding_dim=3, num_embeddings=7, feature_names=["f_a"]),
    EmbeddingBagConfig(
        name="t_wide",
        embedding_dim=129,
        num_embeddings=300,
        feature_names=["f_b", "f_b2"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t_one", embedding_dim=1, num_embeddings=1, feature_names=["f_c"]),
    EmbeddingBagConfig(
        name="t_half",
        embedding_dim=16,
        num_embeddings=1000,
        feature_names=["f_d"],
        data_type=DataType.FP16,
    ),
]
FEATURES = ["f_a", "f_b", "f_b2", "f_c", "f_d"]
ROWS = {"f_a": 7, "f_b": 300, "f_b2": 300, "f_c": 1, "f_d": 1000}
POOLING = {"t_wide": PoolingType.MEAN}


def make_ebc(is_weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES, is_weighted=is_weighted)
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            w = bag.weight
            w.copy_((torch.randn(w.shape) * torch.logspace(-3, 0, w.shape[1])).to(w.dtype))
            w[0] = 0
    return ebc


def random_kjt(batch: int, max_len: int, seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    """Empty bags (the first of every batch), duplicate ids and each table's last row."""
    gen = torch.Generator().manual_seed(seed)
    keys = list(reversed(FEATURES))  # the KJT's key order must not matter
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
    if batch:
        lengths[::batch] = 0
    values = []
    for k, key in enumerate(keys):
        n = int(lengths[k * batch : (k + 1) * batch].sum())
        ids = torch.randint(0, ROWS[key], (n,), generator=gen)
        if n:
            ids[-1] = ROWS[key] - 1
        values.append(ids)
    flat = torch.cat(values)
    weights = torch.rand(flat.numel(), generator=gen) * 4 - 2 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=flat, lengths=lengths, weights=weights)


@pytest.fixture(scope="module")
def ebc() -> EmbeddingBagCollection:
    return make_ebc()


@pytest.fixture(scope="module")
def packed(ebc, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote_ebc")
    pack_table_set(root / "whole", from_torchrec(ebc), sample_rows=None)
    pack_shards(root / "sharded", from_torchrec(ebc), 2, sample_rows=None)
    return root


@pytest.fixture(scope="module")
def server(packed: Path) -> Iterator[RunningServer]:
    with RunningServer(TableStore.load(packed / "whole")) as running:
        yield running


@pytest.fixture(scope="module")
def local(packed: Path, remote) -> CompressedEmbeddingBagCollection:
    # In the server's table order, which from_server keeps.
    names = [c.name for c in remote.embedding_bag_configs()]
    return CompressedEmbeddingBagCollection.from_table_set(packed / "whole", tables=names)


@pytest.fixture(scope="module")
def local_weighted(packed: Path, remote) -> CompressedEmbeddingBagCollection:
    names = [c.name for c in remote.embedding_bag_configs()]
    return CompressedEmbeddingBagCollection.from_table_set(
        packed / "whole", tables=names, is_weighted=True
    )


@pytest.fixture(scope="module")
def remote(server: RunningServer) -> Iterator[RemoteEmbeddingBagCollection]:
    module = RemoteEmbeddingBagCollection.from_server(server.target, pooling=POOLING)
    yield module
    module.close()


def assert_bit_exact(got, expected) -> None:
    assert got.keys() == expected.keys()
    assert got.length_per_key() == expected.length_per_key()
    assert got.values().dtype == torch.float32
    assert got.values().shape == expected.values().shape
    # Bit patterns, so that -0.0 and NaN payloads count too.
    assert torch.equal(got.values().view(torch.int32), expected.values().view(torch.int32))


def test_configs_come_from_list_tables(remote: RemoteEmbeddingBagCollection) -> None:
    configs = {c.name: c for c in remote.embedding_bag_configs()}
    assert sorted(configs) == sorted(c.name for c in TABLES)
    for config in TABLES:
        got = configs[config.name]
        assert (got.embedding_dim, got.num_embeddings) == (
            config.embedding_dim,
            config.num_embeddings,
        )
        assert got.feature_names == config.feature_names
        assert got.pooling == POOLING.get(config.name, PoolingType.SUM)
        assert got.data_type == config.data_type  # the served table's: t_half is FP16
    assert not remote.is_weighted()


@pytest.mark.parametrize("batch", [0, 1, 5, 64])
@pytest.mark.parametrize("max_len", [0, 1, 9])
def test_equals_the_in_process_collection(remote, local, batch: int, max_len: int) -> None:
    for seed in range(2):
        kjt = random_kjt(batch, max_len, seed)
        assert_bit_exact(remote(kjt), local(kjt))


def test_batches_of_different_sizes_one_after_another(remote, local) -> None:
    for seed, batch in enumerate([3, 1, 17, 0, 2]):
        kjt = random_kjt(batch, 5, seed)
        assert_bit_exact(remote(kjt), local(kjt))


def test_weighted(server, local_weighted) -> None:
    with RemoteEmbeddingBagCollection.from_server(
        server.target, pooling=POOLING, is_weighted=True
    ) as module:
        assert module.is_weighted()
        for batch in (1, 8, 33):
            kjt = random_kjt(batch, 6, seed=batch, weighted=True)
            assert_bit_exact(module(kjt), local_weighted(kjt))


def test_all_mean_tables_ask_the_server_for_mean(server, local) -> None:
    # Every table MEAN: the server pools MEAN itself; t_wide's bits must not change.
    all_mean = {c.name: PoolingType.MEAN for c in TABLES}
    with RemoteEmbeddingBagCollection.from_server(
        server.target, ["f_b", "f_b2"], pooling=all_mean
    ) as module:
        kjt = random_kjt(9, 7, seed=3)
        wide = KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in ("f_b", "f_b2")})
        got = module(wide)
        expected = local(kjt)
        assert got.keys() == ["f_b", "f_b2"]
        for key in ("f_b", "f_b2"):
            assert torch.equal(got[key], expected[key])


def test_inverse_indices_expand_the_batch_as_in_torchrec(remote, ebc) -> None:
    # 3 bags per feature answering 5 samples; one id per bag at most, so torchrec's pooled
    # outputs are rows, bit for bit.
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 2, (len(FEATURES) * 3,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, ROWS[f], (int(lengths[3 * k : 3 * k + 3].sum()),), generator=gen)
            for k, f in enumerate(FEATURES)
        ]
    )
    inverse = (FEATURES[::-1], torch.randint(0, 3, (len(FEATURES), 5), generator=gen))
    kjt = KeyedJaggedTensor(FEATURES, values, lengths=lengths, inverse_indices=inverse)
    expected = ebc(kjt)
    for got in (remote(kjt), *remote.lookup_stream([kjt])):
        # from_server lists the tables in the server's order: compared key by key.
        keys = expected.keys()
        assert sorted(got.keys()) == sorted(keys)
        for key in keys:
            assert got[key].shape[0] == 5
            assert torch.equal(got[key], expected[key])


def test_features_select_a_subset(server) -> None:
    with RemoteEmbeddingBagCollection.from_server(
        server.target, ["f_d", "f_b2"], allow_unknown_keys=True
    ) as module:
        configs = module.embedding_bag_configs()
        # In the order asked for; each table reads only the listed features.
        assert [(c.name, c.feature_names) for c in configs] == [
            ("t_half", ["f_d"]),
            ("t_wide", ["f_b2"]),
        ]
        assert module(random_kjt(2, 3, 0)).keys() == ["f_d", "f_b2"]


def test_lookup_stream_equals_forward(remote, local) -> None:
    batches = [random_kjt(b, 4, seed) for seed, b in enumerate([4, 1, 0, 12, 7])]
    results = list(remote.lookup_stream(iter(batches)))
    assert len(results) == len(batches)
    for kjt, got in zip(batches, results, strict=True):
        assert_bit_exact(got, local(kjt))


def test_lookup_stream_names_the_bad_batch(remote) -> None:
    bad = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.tensor([0, 0, 0, 0, 1000]),
        lengths=torch.ones(5, dtype=torch.int64),
    )
    stream = remote.lookup_stream(iter([random_kjt(2, 2, 0), bad]))
    next(stream)
    with pytest.raises(RemoteLookupError, match=r"feature 'f_d'.*1000"):
        next(stream)


class TinyModel(nn.Module):
    """A DLRM's shape in miniature: sparse arch, then a dense layer over the pooled features."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse = ebc
        self.dense = nn.Linear(sum(c.embedding_dim * len(c.feature_names) for c in TABLES), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values())


def test_compress_model_remote_swaps_in_the_server(server) -> None:
    torch.manual_seed(1)
    in_process, remote_model = TinyModel(make_ebc()), TinyModel(make_ebc())
    remote_model.load_state_dict(in_process.state_dict())
    compress_model(in_process, sample_rows=None)
    report = compress_model(remote_model, remote=server.target)
    assert isinstance(remote_model.sparse, RemoteEmbeddingBagCollection)
    assert [r.table for r in report] == [c.name for c in TABLES]
    assert all(r.stored_bytes > 0 and r.raw_bytes > 0 for r in report)
    with torch.no_grad():
        for seed in range(3):
            kjt = random_kjt(16, 5, seed)
            assert torch.equal(remote_model(kjt), in_process(kjt))


def test_the_documented_remote_flow_from_a_state_dict(tmp_path: Path) -> None:
    """docs/torchrec.md: a checkpoint packed with the CLI, served, then compress_model(model,
    remote=...). A state dict holds no feature names: the plain pack is refused with the way out
    named; the CLI's --feature and compress_model(pack_to=...) both give a server the model
    runs on, bit-exact against the in-process swap."""
    torch.manual_seed(2)
    trained = TinyModel(make_ebc())
    torch.save(trained.state_dict(), tmp_path / "model.pt")

    def model() -> TinyModel:
        fresh = TinyModel(make_ebc())
        fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
        return fresh

    in_process = model()
    compress_model(in_process, sample_rows=None)
    plain, named = tmp_path / "plain", tmp_path / "named"
    assert main_cli(["pack", str(tmp_path / "model.pt"), "-o", str(plain), "--no-progress"]) == 0
    with (
        RunningServer(TableStore.load(plain)) as running,
        pytest.raises(
            KeyError, match=r"pack_to=DIR\), or `ibpembed pack ... --feature f_a=t_small`"
        ),
    ):
        compress_model(model(), remote=running.target)
    features = [f"--feature={f}={c.name}" for c in TABLES for f in c.feature_names]
    argv = ["pack", str(tmp_path / "model.pt"), "-o", str(named), "--no-progress", *features]
    assert main_cli(argv) == 0
    report = compress_model(model(), pack_to=tmp_path / "from_model", sample_rows=None)
    assert [(r.module, r.table) for r in report] == [("sparse", c.name) for c in TABLES]
    assert all(r.stored_bytes > 0 for r in report)
    for directory in (named, tmp_path / "from_model"):
        with RunningServer(TableStore.load(directory)) as running:
            remote_model = model()
            compress_model(remote_model, remote=running.target)
            with torch.no_grad():
                for seed in range(2):
                    kjt = random_kjt(8, 4, seed)
                    assert torch.equal(remote_model(kjt), in_process(kjt))
            remote_model.sparse.close()
    with pytest.raises(TypeError, match="pack_to and remote"):
        compress_model(model(), pack_to=tmp_path / "x", remote="127.0.0.1:1")


def test_row_sharded_servers(packed: Path, ebc) -> None:
    shards = [
        RunningServer(TableStore.load(packed / "sharded" / f"shard-{k}-of-2")) for k in range(2)
    ]
    try:
        with RemoteEmbeddingBagCollection.from_server(
            [s.target for s in shards], FEATURES, pooling=POOLING
        ) as module:
            assert [c.num_embeddings for c in module.embedding_bag_configs()] == [
                c.num_embeddings for c in TABLES
            ]
            for seed, batch in enumerate([1, 16]):
                kjt = random_kjt(batch, 8, seed)
                got, expected = module(kjt), ebc(kjt)
                assert got.keys() == expected.keys()
                diff = (got.values().double() - expected.values().detach().double()).abs()
                assert bool((diff <= pooled_error_bound(ebc, kjt)).all())
    finally:
        for s in shards:
            s.stop()


def connections_to(port: int) -> int:
    """Established TCP connections whose far end is ``port`` on this host: the clients' ends."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            _, _, far, state = line.split()[:4]
            count += state == "01" and int(far.rsplit(":", 1)[1], 16) == port
    return count


def test_close_releases_the_connection_compress_model_shares(packed: Path) -> None:
    model = nn.Module()
    model.first = EmbeddingBagCollection(tables=TABLES[:2], device=torch.device("meta"))
    model.second = EmbeddingBagCollection(tables=TABLES[2:], device=torch.device("meta"))
    with RunningServer(TableStore.load(packed / "whole")) as running:
        compress_model(model, remote=running.target, allow_unknown_keys=True)
        kjt = random_kjt(4, 3, seed=0)
        model.first(kjt), model.second(kjt)
        port = int(running.target.rsplit(":", 1)[1])
        assert connections_to(port) > 0
        model.first.close()
        model.first.close()  # again: nothing more to release
        with pytest.raises(
            RuntimeError, match=r"RemoteEmbeddingBagCollection \(127.0.0.1:\d+\) is closed"
        ):
            model.first(kjt)
        assert model.second(kjt).values().shape == (4, 1 + 16)  # still open for the other
        model.second.close()
        deadline = time.monotonic() + 10
        while connections_to(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert connections_to(port) == 0


def test_options_that_would_do_nothing_are_refused(server, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="client_options applies to remote collections only"):
        compress_model(TinyModel(make_ebc()), client_options={"timeout": 1.0})
    with pytest.raises(TypeError, match="allow_unknown_keys does not apply to pack_to"):
        compress_model(TinyModel(make_ebc()), True, pack_to=tmp_path)
    with pytest.raises(TypeError, match="client_options applies to remote collections only"):
        compress_model(TinyModel(make_ebc()), pack_to=tmp_path, client_options={"timeout": 1.0})
    assert not any(tmp_path.iterdir())
    # Pooling is per table; a feature name there would silently pool with SUM.
    with pytest.raises(ValueError, match=r"pooling names \['f_b'\], which 127.0.0.1:\d+ does not"):
        RemoteEmbeddingBagCollection.from_server(server.target, pooling={"f_b": PoolingType.MEAN})


# -- bad input and failures: clear errors naming the feature -------------------------------------


def test_a_feature_the_server_lacks(server) -> None:
    with pytest.raises(KeyError, match=r"feature 'f_zz' is not served by 127.0.0.1"):
        RemoteEmbeddingBagCollection.from_server(server.target, ["f_a", "f_zz"])
    other = [
        *TABLES,
        EmbeddingBagConfig(name="t_x", embedding_dim=4, num_embeddings=5, feature_names=["f_zz"]),
    ]
    model = TinyModel(EmbeddingBagCollection(tables=other, device=torch.device("meta")))
    with pytest.raises(KeyError, match=r"feature 'f_zz' \(table 't_x'\) is not served"):
        compress_model(model, remote=server.target)


def test_a_failed_remote_swap_changes_nothing(server) -> None:
    model = nn.Module()
    model.first = first = make_ebc()
    unserved = EmbeddingBagConfig(
        name="t_x", embedding_dim=4, num_embeddings=5, feature_names=["f_zz"]
    )
    model.second = second = EmbeddingBagCollection(tables=[unserved], device=torch.device("meta"))
    with pytest.raises(KeyError, match=r"feature 'f_zz' \(table 't_x'\) is not served"):
        compress_model(model, remote=server.target)
    assert model.first is first and model.second is second


def test_a_dim_that_differs_from_the_config(server) -> None:
    wrong = [
        EmbeddingBagConfig(
            name="t_wide", embedding_dim=128, num_embeddings=300, feature_names=["f_b"]
        )
    ]
    model = TinyModel(EmbeddingBagCollection(tables=wrong, device=torch.device("meta")))
    with pytest.raises(
        ValueError, match=r"feature 'f_b' \(table 't_wide'\): the config says dim 128.*129"
    ):
        compress_model(model, remote=server.target)


def test_rows_that_differ_from_the_config(server) -> None:
    wrong = [EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=8, feature_names=["f_a"])]
    model = TinyModel(EmbeddingBagCollection(tables=wrong, device=torch.device("meta")))
    with pytest.raises(ValueError, match=r"feature 'f_a'.*8 rows.*7 rows"):
        compress_model(model, remote=server.target)


def test_a_feature_read_by_two_tables_is_refused(server) -> None:
    shared = [
        EmbeddingBagConfig(
            name="t_small", embedding_dim=3, num_embeddings=7, feature_names=["f_a"]
        ),
        EmbeddingBagConfig(
            name="t_other", embedding_dim=3, num_embeddings=7, feature_names=["f_a"]
        ),
    ]
    model = TinyModel(EmbeddingBagCollection(tables=shared, device=torch.device("meta")))
    with pytest.raises(ValueError, match="feature 'f_a' is read by tables 't_small' and 't_other'"):
        compress_model(model, remote=server.target)


def test_a_dtype_that_differs_from_the_config(server) -> None:
    # t_half is served as float16 rows; a model whose t_half is fp32 pools other values.
    fp32 = [replace(c, data_type=DataType.FP32) for c in TABLES]
    model = TinyModel(EmbeddingBagCollection(tables=fp32, device=torch.device("meta")))
    with pytest.raises(
        ValueError,
        match=r"feature 'f_d' \(table 't_half'\): the config says FP32, .* holding float16 rows "
        r"\(pass allow_dtype_mismatch=True",
    ):
        compress_model(model, remote=server.target)
    compress_model(model, remote=server.target, allow_dtype_mismatch=True)
    assert isinstance(model.sparse, RemoteEmbeddingBagCollection)
    model.sparse.close()
    with pytest.raises(TypeError, match="allow_dtype_mismatch applies to remote"):
        compress_model(TinyModel(make_ebc()), allow_dtype_mismatch=True)


def test_a_feature_served_from_another_table_is_refused(tmp_path: Path) -> None:
    """A checkpoint packed with its aliases crossed (--feature f0=t1 --feature f1=t0) serves
    every feature from a table of the right shape, but the other one: refused, naming both
    tables, unless the model's tables are served under other names on purpose."""
    pair = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f"f{i}"]
        )
        for i in range(2)
    ]
    model = TinyModel(EmbeddingBagCollection(tables=pair))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    argv = ["pack", str(tmp_path / "model.pt"), "-o", str(tmp_path / "set"), "--no-progress"]
    assert main_cli([*argv, "--feature", "f0=t1", "--feature", "f1=t0"]) == 0
    with RunningServer(TableStore.load(tmp_path / "set")) as running:
        with pytest.raises(
            ValueError,
            match=r"feature 'f0' \(table 't0'\): 127.0.0.1:\d+ serves it from table 't1' .*"
            r"pass allow_table_name_mismatch=True",
        ):
            compress_model(model, remote=running.target)
        assert not isinstance(model.sparse, RemoteEmbeddingBagCollection)
        compress_model(model, remote=running.target, allow_table_name_mismatch=True)
        assert isinstance(model.sparse, RemoteEmbeddingBagCollection)
        model.sparse.close()
    with pytest.raises(TypeError, match="allow_table_name_mismatch applies to remote"):
        compress_model(TinyModel(make_ebc()), allow_table_name_mismatch=True)


def test_a_feature_listed_twice(server) -> None:
    with pytest.raises(ValueError, match="feature 'f_a' is listed twice in features"):
        RemoteEmbeddingBagCollection.from_server(server.target, ["f_a", "f_b", "f_a"])


def test_int8_rowwise_rows_need_an_int8_config() -> None:
    with RunningServer(make_store()) as running:
        # The store's "quant" feature reads 300 int8_rowwise rows of 12 codes: pooled dim 12.
        with RemoteEmbeddingBagCollection.from_server(running.target, ["quant"]) as module:
            (config,) = module.embedding_bag_configs()
            assert (config.data_type, config.embedding_dim) == (DataType.INT8, 12)
            assert module(
                KeyedJaggedTensor(
                    keys=["quant"], values=torch.tensor([1]), lengths=torch.tensor([1])
                )
            ).values().shape == (1, 12)
        fp32 = EmbeddingBagConfig(
            name="emb_q8", embedding_dim=12, num_embeddings=300, feature_names=["quant"]
        )
        model = TinyModel(EmbeddingBagCollection(tables=[fp32], device=torch.device("meta")))
        with pytest.raises(ValueError, match=r"'emb_q8'\): the config says FP32.*int8_rowwise"):
            compress_model(model, remote=running.target)


def test_a_table_of_raw_bytes_is_not_pooled(tmp_path: Path) -> None:
    codes = TableSource("raw", torch.randint(0, 255, (20, 8), dtype=torch.uint8))
    pack_table_set(tmp_path, TableSet((codes,)), sample_rows=None)
    with RunningServer(TableStore.load(tmp_path)) as running:
        with pytest.raises(ValueError, match="table 'raw' holds uint8 rows, which cannot"):
            RemoteEmbeddingBagCollection.from_server(running.target, ["raw"])
        with RemoteEmbeddingBagCollection.from_server(running.target) as module:
            assert module.embedding_bag_configs() == []


def test_a_cast_model_is_served_the_weights_it_pools(tmp_path: Path) -> None:
    # .half() leaves the configs FP32; the packed rows and the remote configs are fp16.
    torch.manual_seed(3)
    model = TinyModel(make_ebc()).half()
    in_process = TinyModel(make_ebc()).half()
    in_process.load_state_dict(model.state_dict())
    compress_model(in_process, sample_rows=None)
    compress_model(model, pack_to=tmp_path, sample_rows=None)
    with RunningServer(TableStore.load(tmp_path)) as running:
        compress_model(model, remote=running.target)
        for seed in range(2):
            kjt = random_kjt(8, 4, seed)
            assert_bit_exact(model.sparse(kjt), in_process.sparse(kjt))
        model.sparse.close()


def test_an_out_of_range_id_names_the_feature(remote) -> None:
    kjt = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.tensor([0, 0, 0, 5, 0]),
        lengths=torch.ones(5, dtype=torch.int64),
    )
    with pytest.raises(RemoteLookupError, match=r"INVALID_ARGUMENT.*feature 'f_c'"):
        remote(kjt)


def test_two_dimensional_lengths(remote) -> None:
    kjt = random_kjt(2, 1, 0)
    flat = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths().reshape(5, 2))
    with pytest.raises(
        ValueError, match=r"lengths must be 1-D \(keys x batch\), got shape \[5, 2\]"
    ):
        remote(flat)


def test_a_kjt_missing_a_feature(remote) -> None:
    kjt = KeyedJaggedTensor(keys=["f_a"], values=torch.tensor([0]), lengths=torch.tensor([1]))
    with pytest.raises(KeyError, match=r"feature 'f_\w+' is missing from the KJT"):
        remote(kjt)


def test_an_unknown_kjt_key(remote) -> None:
    kjt = random_kjt(1, 1, 0)
    extra = KeyedJaggedTensor.from_jt_dict(
        {
            **kjt.to_dict(),
            "f_new": KeyedJaggedTensor(
                keys=["f_new"], values=torch.tensor([1]), lengths=torch.tensor([1])
            )["f_new"],
        }
    )
    with pytest.raises(KeyError, match="KJT key 'f_new' is not read by any table"):
        remote(extra)


def test_a_weighted_collection_without_weights(server) -> None:
    with (
        RemoteEmbeddingBagCollection.from_server(server.target, is_weighted=True) as module,
        pytest.raises(ValueError, match="weighted: the KJT has no weights"),
    ):
        module(random_kjt(2, 2, 0))


def test_a_dead_server(packed: Path) -> None:
    running = RunningServer(TableStore.load(packed / "whole"))
    target = running.target
    module = RemoteEmbeddingBagCollection.from_server(target, timeout=5.0)
    running.stop()
    with pytest.raises(
        RemoteLookupError, match=rf"cannot reach ibpembed server {target} \(features \[.*'f_a'"
    ):
        module(random_kjt(2, 2, 0))
    module.close()
    with pytest.raises(ConnectionError, match=rf"ibpembed server {target}: cannot list its tables"):
        RemoteEmbeddingBagCollection.from_server(target, timeout=2.0)


def test_traced_as_a_leaf_in_a_model(server) -> None:
    from torchrec.fx import symbolic_trace

    # torchrec's tracer cannot enter the remote module (its forward turns the KJT's tensors
    # into a request: numpy on an FX proxy fails); as a leaf the traced model calls it.
    with RemoteEmbeddingBagCollection.from_server(server.target, pooling=POOLING) as module:
        model = TinyModel(module)
        model.dense = nn.Linear(module(random_kjt(1, 1, 0)).values().shape[1], 1)
        traced = symbolic_trace(model, leaf_modules=["RemoteEmbeddingBagCollection"])
        kjt = random_kjt(6, 4, seed=9)
        with torch.no_grad():
            assert torch.equal(traced(kjt), model(kjt))
            with pytest.raises(Exception, match=r"numpy|Proxy|iterate"):
                symbolic_trace(model)
