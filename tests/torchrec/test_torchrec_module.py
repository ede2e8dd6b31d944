# SPDX-License-Identifier: Apache-2.0
"""CompressedEmbeddingBagCollection against torchrec's own EmbeddingBagCollection.

Pooled outputs are compared with a bound derived from fp32 summation error
(``pooled_error_bound``), never a guessed atol; table rows must be bit-exact.
"""

import io
import re
from dataclasses import replace

import numpy as np
import pytest

# NOTE: this folder has no __init__.py on purpose: as a package named "torchrec" on sys.path it
# would shadow the real torchrec. A submodule is imported so that the skip also fires when only
# that namespace directory is importable.
pytest.importorskip("torchrec.modules.embedding_modules", reason="torchrec is not installed")

import torch
from torchrec import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.fx import symbolic_trace

import ibpembed.torchrec.bag as bag_impl
from ibpembed.cli import main as main_cli
from ibpembed.codec import compress
from ibpembed.tables.importers import TableSet, TableSource, from_torchrec
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from ibpembed.torchrec import (
    CompressedEmbeddingBagCollection,
    compress_model,
    format_table_bytes,
    pooled_error_bound,
)
from tests.cuda import cuda_kernels_missing

# Awkward shapes on purpose: D = 1, 3, 129; a feature shared by two tables (named f@table);
# a table read by two features; SUM and MEAN mixed.
TABLES = [
    EmbeddingBagConfig(name="t_small", embedding_dim=3, num_embeddings=7, feature_names=["f_a"]),
    EmbeddingBagConfig(
        name="t_wide",
        embedding_dim=129,
        num_embeddings=300,
        feature_names=["f_b", "f_shared"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="t_one", embedding_dim=1, num_embeddings=1, feature_names=["f_c"]),
    EmbeddingBagConfig(
        name="t_mid", embedding_dim=16, num_embeddings=1000, feature_names=["f_shared"]
    ),
]


def make_ebc(tables: list[EmbeddingBagConfig], is_weighted: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=is_weighted)
    # Trained-like rows: a spread of magnitudes, plus a zero row and an outlier (IBP's weak spot).
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            w = bag.weight
            w.copy_(torch.randn_like(w) * torch.logspace(-3, 0, w.shape[1], dtype=w.dtype))
            w[0] = 0
            w[-1, 0] = 1e4
    return ebc


def random_kjt(
    ebc: EmbeddingBagCollection,
    batch: int,
    max_len: int,
    seed: int,
    weighted: bool = False,
    key_order: list[str] | None = None,
) -> KeyedJaggedTensor:
    """A KJT with empty bags, duplicate ids (small tables) and the largest valid id."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, int] = {}
    for c in ebc.embedding_bag_configs():
        for f in c.feature_names:  # a shared feature must fit its smallest table
            rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
    keys = key_order or list(rows)
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=gen)
    if batch:
        lengths[0] = 0
    values = []
    for k, key in enumerate(keys):
        n = int(lengths[k * batch : (k + 1) * batch].sum())
        ids = torch.randint(0, rows.get(key, 10), (n,), generator=gen)
        if n:
            ids[-1] = rows.get(key, 10) - 1
        values.append(ids)
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=gen) * 4 - 2 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def assert_same_as_torchrec(
    ebc: EmbeddingBagCollection, ours: torch.nn.Module, kjt: KeyedJaggedTensor
) -> None:
    expected = ebc(kjt)
    got = ours(kjt)
    assert got.keys() == expected.keys()
    assert got.length_per_key() == expected.length_per_key()
    assert got.values().dtype == torch.float32
    diff = (got.values().double() - expected.values().detach().double()).abs()
    bound = pooled_error_bound(ebc, kjt)
    assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"


@pytest.fixture(scope="module")
def mixed():
    ebc = make_ebc(TABLES)
    return ebc, CompressedEmbeddingBagCollection.from_ebc(ebc)


@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("max_len", [0, 1, 9])
def test_matches_torchrec_mixed_dims_and_pooling(mixed, batch: int, max_len: int) -> None:
    ebc, ours = mixed
    for seed in range(3):
        assert_same_as_torchrec(ebc, ours, random_kjt(ebc, batch, max_len, seed))


def test_key_order_of_the_kjt_does_not_matter(mixed) -> None:
    ebc, ours = mixed
    kjt = random_kjt(ebc, 8, 4, seed=1, key_order=["f_shared", "f_c", "f_b", "f_a"])
    assert_same_as_torchrec(ebc, ours, kjt)
    assert ours(kjt).keys() == ["f_a", "f_b", "f_shared@t_wide", "f_c", "f_shared@t_mid"]


def test_int32_ids_and_lengths(mixed) -> None:
    ebc, ours = mixed
    kjt = random_kjt(ebc, 8, 4, seed=2)
    kjt32 = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values().int(), lengths=kjt.lengths().int()
    )
    torch.testing.assert_close(ours(kjt32).values(), ours(kjt).values(), rtol=0, atol=0)


def test_duplicate_ids_heavy() -> None:
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=3, feature_names=["f"])]
    ebc = make_ebc(tables)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([2] * 40 + [1, 1, 0]), lengths=torch.tensor([40, 0, 3])
    )
    assert_same_as_torchrec(ebc, ours, kjt)


@pytest.mark.parametrize("batch", [1, 33])
def test_weighted_collection(batch: int) -> None:
    tables = [
        EmbeddingBagConfig(name="w1", embedding_dim=5, num_embeddings=40, feature_names=["x"]),
        EmbeddingBagConfig(name="w2", embedding_dim=12, num_embeddings=9, feature_names=["y"]),
    ]
    ebc = make_ebc(tables, is_weighted=True)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    assert ours.is_weighted()
    for seed in range(3):
        assert_same_as_torchrec(ebc, ours, random_kjt(ebc, batch, 6, seed, weighted=True))


def test_non_contiguous_kjt_values_lengths_and_weights() -> None:
    tables = [
        EmbeddingBagConfig(name="w1", embedding_dim=5, num_embeddings=40, feature_names=["x"]),
        EmbeddingBagConfig(name="w2", embedding_dim=12, num_embeddings=9, feature_names=["y"]),
    ]
    ebc = make_ebc(tables, is_weighted=True)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    dense = random_kjt(ebc, 7, 4, seed=5, weighted=True)
    strided = KeyedJaggedTensor(  # every tensor a view of every other element of a larger one
        keys=dense.keys(),
        values=torch.stack([dense.values(), dense.values()], 1).view(-1)[::2],
        lengths=torch.stack([dense.lengths(), dense.lengths()], 1).view(-1)[::2],
        weights=torch.stack([dense.weights(), dense.weights()], 1).view(-1)[::2],
    )
    assert not strided.values().is_contiguous() and not strided.weights().is_contiguous()
    assert torch.equal(ours(strided).values(), ours(dense).values())
    assert_same_as_torchrec(ebc, ours, strided)


def test_a_meta_placeholder_moves_like_any_module() -> None:
    with torch.device("meta"):
        placeholder = CompressedEmbeddingBagCollection(TABLES)
    moved = placeholder.to_empty(device="cpu")
    assert all(b.payload.device.type == "cpu" for b in moved.embedding_bags.values())


def deduplicated_kjt(rows: dict[str, int]) -> KeyedJaggedTensor:
    """3 bags per feature answering 5 samples through inverse indices, listed in their own key
    order (torchrec looks each feature up by name). Bags hold at most one id, so torchrec's
    pooled outputs are rows, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    keys = list(rows)
    lengths = torch.randint(0, 2, (len(keys) * 3,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, rows[key], (int(lengths[3 * k : 3 * k + 3].sum()),), generator=gen)
            for k, key in enumerate(keys)
        ]
    )
    inverse = torch.randint(0, 3, (len(keys), 5), generator=gen)
    return KeyedJaggedTensor(
        keys=keys, values=values, lengths=lengths, inverse_indices=(keys[::-1], inverse)
    )


def test_inverse_indices_expand_the_batch_as_in_torchrec(mixed) -> None:
    ebc, ours = mixed
    kjt = deduplicated_kjt({"f_a": 7, "f_b": 300, "f_shared": 300, "f_c": 1})
    expected = ebc(kjt)
    for module in (ours, torch.jit.script(ours), symbolic_trace(ours)):
        got = module(kjt)
        assert got.keys() == expected.keys()
        assert got.values().shape == (5, 3 + 129 + 129 + 1 + 16)
        assert torch.equal(got.values(), expected.values())
    keys, inverse = kjt.inverse_indices()
    partial = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
        inverse_indices=(keys[1:], inverse[1:]),
    )  # fmt: skip
    with pytest.raises(KeyError, match="feature 'f_c' has no inverse indices"):
        ours(partial)


def test_unweighted_collection_ignores_weights_like_torchrec(mixed) -> None:
    ebc, ours = mixed
    assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 8, 4, seed=3, weighted=True))


def test_fp16_tables() -> None:
    tables = [
        EmbeddingBagConfig(
            name="h",
            embedding_dim=8,
            num_embeddings=50,
            feature_names=["h"],
            data_type=DataType.FP16,
        ),
        EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=50, feature_names=["s"]),
    ]
    ebc = make_ebc(tables)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 16, 30, seed=0))


# torchrec holds every table whose config is not FP32 as fp16 weights; .half() and
# .to(torch.bfloat16) cast the weights and leave the configs as they were.
LOW_PRECISION = {
    "FP16 config": (DataType.FP16, None),
    "BF16 config": (DataType.BF16, None),
    "half()": (DataType.FP32, torch.float16),
    "to(bfloat16)": (DataType.FP32, torch.bfloat16),
}


def low_precision_ebc(tables: list[EmbeddingBagConfig], how: str) -> EmbeddingBagCollection:
    data_type, cast = LOW_PRECISION[how]
    ebc = make_ebc([replace(c, data_type=data_type) for c in tables])
    return ebc if cast is None else ebc.to(cast)


@pytest.mark.parametrize("how", list(LOW_PRECISION))
def test_low_precision_weights_are_compressed_as_torchrec_holds_them(how: str) -> None:
    ebc = low_precision_ebc(TABLES, how)
    model = torch.nn.Sequential(ebc)
    compress_model(model)
    ours = model[0]
    for config in ours.embedding_bag_configs():
        weight = ebc.embedding_bags[config.name].weight.detach()
        # The config says the weight's dtype, so a module built from it loads the state dict.
        assert bag_impl.TORCH_DTYPES[config.data_type] == weight.dtype
        rows = ours.embedding_bags[config.name].compressed_table().decompress()
        assert torch.equal(rows.view(torch.int16), weight.view(torch.int16))
    for seed in range(3):
        assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 16, 4, seed=seed))
    fresh = CompressedEmbeddingBagCollection(ours.embedding_bag_configs())
    fresh.load_state_dict(ours.state_dict())
    kjt = random_kjt(ebc, 8, 4, seed=5)
    assert torch.equal(fresh(kjt).values(), ours(kjt).values())


def test_dtype_errors_name_the_table() -> None:
    with pytest.raises(TypeError, match=r"table 't_small': weights are torch.float64"):
        CompressedEmbeddingBagCollection.from_ebc(make_ebc(TABLES).double())
    ebc = make_ebc(TABLES[:1])
    half = compress(ebc.embedding_bags["t_small"].weight.detach().half())
    with pytest.raises(ValueError, match=r"table 't_small': compressed table is 7x3 torch.float16"):
        CompressedEmbeddingBagCollection(TABLES[:1], compressed={"t_small": half})


# Rows in [0.5, 1.5) put every pooled sum among the low-precision format's coarse steps, and
# torchrec's MEAN rounds the sum and then the quotient; rows scaled into fp16's subnormal range
# make fp16's roundings' errors absolute instead of relative.
@pytest.mark.parametrize("scale", [1.0, 2.0**-20])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("how", list(LOW_PRECISION))
def test_the_bound_holds_where_torchrec_rounds_its_outputs(
    how: str, pooling: PoolingType, scale: float
) -> None:
    beyond_one_rounding = 0
    for length in (1, 2, 3, 5, 7, 10, 100):
        gen = torch.Generator().manual_seed(length)
        config = EmbeddingBagConfig(
            name="t", embedding_dim=256, num_embeddings=64, feature_names=["f"], pooling=pooling
        )
        ebc = low_precision_ebc([config], how)
        weight = ebc.embedding_bags["t"].weight
        with torch.no_grad():
            weight.copy_((torch.rand(weight.shape, generator=gen) + 0.5) * scale)
        ids = torch.randint(0, 64, (32 * length,), generator=gen)
        kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.full((32,), length))
        expected = ebc(kjt).values().double()
        got = CompressedEmbeddingBagCollection.from_ebc(ebc)(kjt).values().double()
        diff = (got - expected).abs()
        bound = pooled_error_bound(ebc, kjt)
        assert bool((diff <= bound).all()), f"L={length}: max excess {float((diff - bound).max())}"
        exact = weight.detach().double()[ids.view(32, length)].sum(1)
        if pooling == PoolingType.MEAN:
            exact = exact / length
        unit = 2.0**-11 if weight.dtype == torch.float16 else 2.0**-8
        beyond_one_rounding += int((diff > unit * exact.abs()).sum())
    if pooling == PoolingType.MEAN:
        # The inputs do reach the double rounding a single rounding cannot account for.
        assert beyond_one_rounding > 0


def test_rows_are_bit_exact(mixed) -> None:
    ebc, ours = mixed
    for config in ebc.embedding_bag_configs():
        weight = ebc.embedding_bags[config.name].weight.detach()
        table = ours.embedding_bags[config.name].compressed_table()
        rows = table.decompress()
        assert rows.dtype == weight.dtype
        assert torch.equal(rows.view(torch.int32), weight.view(torch.int32))
        ids = torch.tensor([config.num_embeddings - 1, 0, config.num_embeddings - 1])
        assert torch.equal(table.gather(ids).view(torch.int32), weight[ids].view(torch.int32))


def test_empty_batch(mixed) -> None:
    _, ours = mixed
    keys = ["f_a", "f_b", "f_shared", "f_c"]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.empty(0, dtype=torch.int64),
    )
    assert ours(kjt).values().shape == (0, 3 + 129 + 129 + 1 + 16)


def test_configs_and_interface(mixed) -> None:
    ebc, ours = mixed
    assert [c.name for c in ours.embedding_bag_configs()] == [c.name for c in TABLES]
    assert ours.embedding_bag_configs()[1].pooling == PoolingType.MEAN
    assert not ours.is_weighted()
    # The configs are copies: editing ours must not reach the source model.
    assert ours.embedding_bag_configs()[0] is not ebc.embedding_bag_configs()[0]


def test_unsupported_configs_are_rejected() -> None:
    none_pool = EmbeddingBagConfig(
        name="n", embedding_dim=4, num_embeddings=4, feature_names=["n"], pooling=PoolingType.NONE
    )
    with pytest.raises(ValueError, match="pooling must be SUM or MEAN"):
        CompressedEmbeddingBagCollection([none_pool])
    int8 = EmbeddingBagConfig(
        name="q", embedding_dim=4, num_embeddings=4, feature_names=["q"], data_type=DataType.INT8
    )
    with pytest.raises(ValueError, match="data_type must be FP32, FP16 or BF16"):
        CompressedEmbeddingBagCollection([int8])
    with pytest.raises(TypeError, match="EmbeddingBagCollection"):
        CompressedEmbeddingBagCollection.from_ebc(torch.nn.Linear(2, 2))


# -- bad input: clear errors, raised before any kernel runs --------------------------------------


@pytest.fixture()
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replaces the ops the module calls with a recorder, to prove checks come first."""
    calls: list[str] = []

    class Recorder:
        def lookup_pooled(self, *args):
            calls.append("lookup_pooled")
            raise AssertionError("a kernel ran before the batch was validated")

    monkeypatch.setattr(bag_impl, "ops", Recorder())
    return calls


def kjt_of(keys, values, lengths, weights=None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights, dtype=torch.float32),
    )


GOOD = {"f_a": [1], "f_b": [2], "f_shared": [3], "f_c": [0]}


def batch_with(**override) -> KeyedJaggedTensor:
    ids = {**GOOD, **override}
    return kjt_of(list(ids), [i for v in ids.values() for i in v], [len(v) for v in ids.values()])


@pytest.mark.parametrize(
    ("kjt", "error", "match"),
    [
        (
            batch_with(f_c=[1]),
            IndexError,
            r"feature 'f_c' \(table 't_one'\): id 1 .*table of 1 rows",
        ),
        (batch_with(f_a=[-1]), IndexError, r"id -1 at position 0 .*table of 7 rows"),
        # f_shared feeds t_wide (300 rows) and t_mid (1000 rows): 500 is only bad for t_wide.
        (batch_with(f_shared=[500]), IndexError, r"table 't_wide'\): id 500"),
        (batch_with(f_zz=[0]), KeyError, r"KJT key 'f_zz' is not read by any table"),
        (kjt_of(["f_a", "f_b", "f_shared"], [1, 2, 3], [1, 1, 1]), KeyError, "'f_c' is missing"),
        (
            kjt_of(["f_a", "f_b", "f_shared", "f_c"], [1, 2, 3], [1, 1, 1, 1]),
            ValueError,
            "lengths sum to 4 but there are 3 values",
        ),
        (
            kjt_of(["f_a", "f_b", "f_shared", "f_c"], [1, 2, 3, 0], [2, -1, 1, 1, 1]),
            ValueError,
            r"lengths has 5 entries, expected 4 keys x batch 1 = 4",
        ),
        (
            KeyedJaggedTensor(
                keys=["f_a", "f_b", "f_shared", "f_c"],
                values=torch.tensor([1, 2, 3, 0]),
                lengths=torch.ones(2, 2, dtype=torch.int64),
            ),
            ValueError,
            r"lengths must be 1-D \(keys x batch\), got shape \[2, 2\]",
        ),
        (
            kjt_of(["f_a", "f_b", "f_shared", "f_c"], [1, 2, 0, 0], [2, -1, 2, 1]),
            ValueError,
            "lengths must be non-negative",
        ),
        (
            kjt_of(["f_a", "f_b", "f_shared", "f_c"], [1.0, 2.0, 3.0, 0.0], [1, 1, 1, 1]),
            TypeError,
            "must be integer ids",
        ),
    ],
)
def test_bad_batches_fail_before_any_kernel(mixed, no_kernels, kjt, error, match) -> None:
    _, ours = mixed
    with pytest.raises(error, match=match):
        ours(kjt)
    assert no_kernels == []


def test_weighted_collection_needs_matching_weights(no_kernels) -> None:
    tables = [EmbeddingBagConfig(name="w", embedding_dim=4, num_embeddings=9, feature_names=["x"])]
    ours = CompressedEmbeddingBagCollection.from_ebc(make_ebc(tables, is_weighted=True))
    with pytest.raises(ValueError, match="must carry weights"):
        ours(kjt_of(["x"], [1, 2], [2]))
    with pytest.raises(ValueError, match="1 weights for 2 values"):
        ours(kjt_of(["x"], [1, 2], [2], weights=[0.5]))
    assert no_kernels == []


def test_unknown_keys_can_be_allowed(mixed) -> None:
    ebc, _ = mixed
    lenient = CompressedEmbeddingBagCollection.from_ebc(ebc, allow_unknown_keys=True)
    got = lenient(batch_with(f_zz=[99]))
    assert got.keys() == ebc(batch_with()).keys()
    torch.testing.assert_close(got.values(), lenient(batch_with()).values(), rtol=0, atol=0)


def test_variable_batch_kjt_is_rejected(mixed) -> None:
    _, ours = mixed
    kjt = KeyedJaggedTensor(
        keys=["f_a", "f_b", "f_shared", "f_c"],
        values=torch.tensor([1, 2, 3, 0, 0]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [1], [1], [2]],
    )
    with pytest.raises(NotImplementedError, match="VBE"):
        ours(kjt)


# -- state_dict ----------------------------------------------------------------------------------


def test_state_dict_round_trip(mixed) -> None:
    ebc, ours = mixed
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    fresh = CompressedEmbeddingBagCollection(TABLES)
    with pytest.raises(RuntimeError, match="has no table"):
        fresh(batch_with())
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    kjt = random_kjt(ebc, 16, 5, seed=7)
    torch.testing.assert_close(fresh(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
    for name, bag in fresh.embedding_bags.items():
        weight = ebc.embedding_bags[name].weight.detach()
        assert torch.equal(
            bag.compressed_table().decompress().view(torch.int32), weight.view(torch.int32)
        )


def test_state_dict_mismatches_are_reported(mixed) -> None:
    _, ours = mixed
    state = ours.state_dict()
    other = [replace(c, num_embeddings=c.num_embeddings + 1) for c in TABLES]
    with pytest.raises(
        RuntimeError, match=r"embedding_bags\.t_small\.meta: state holds a 7x3 table .* expects 8x3"
    ):
        CompressedEmbeddingBagCollection(other).load_state_dict(state)
    old = dict(state)
    old["embedding_bags.t_small.meta"] = old["embedding_bags.t_small.meta"].clone()
    old["embedding_bags.t_small.meta"][0] = 99
    with pytest.raises(RuntimeError, match="state version 99 is not supported"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(old)
    old["embedding_bags.t_small.meta"][0] = state["embedding_bags.t_small.meta"][0]
    old["embedding_bags.t_small.meta"][1] = 99
    with pytest.raises(RuntimeError, match="compact layout version 99, this build decodes"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(old)
    partial = {k: v for k, v in state.items() if not k.endswith("t_one.payload")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*t_one.payload"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(partial)
    extra = {**state, "embedding_bags.t_one.junk": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*t_one.junk"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(extra)


def _tampered(state: dict, key: str, how: str) -> dict:
    tensor = state[key]
    if how == "truncated":
        tensor = tensor[: max(1, tensor.numel() // 8)].clone()
    elif how == "dtype":
        tensor = tensor.to(torch.int64 if tensor.dtype == torch.int32 else torch.int32)
    elif how == "other table's":  # a table of another shape: every size disagrees
        tensor = state[key.replace("t_mid", "t_wide")]
    return {**state, key: tensor}


@pytest.mark.parametrize("how", ["truncated", "dtype", "other table's"])
@pytest.mark.parametrize(
    "buffer", ["payload", "block_base", "row_units", "bitmask", "mask", "bitval"]
)
def test_a_bad_buffer_fails_the_load_naming_it_and_changes_nothing(
    mixed, buffer: str, how: str
) -> None:
    ebc, ours = mixed
    state = ours.state_dict()
    bad = _tampered(state, f"embedding_bags.t_mid.{buffer}", how)
    target = CompressedEmbeddingBagCollection.from_ebc(make_ebc(TABLES, seed=5))
    kjt = random_kjt(ebc, 16, 5, seed=7)
    before = target(kjt).values()
    buffers = target.state_dict()
    with pytest.raises(RuntimeError, match=rf"embedding_bags\.t_mid\.{buffer}\b"):
        target.load_state_dict(bad)
    # Not even the tables whose buffers were fine (loaded before t_mid) changed.
    after = target.state_dict()
    assert after.keys() == buffers.keys()
    for key, tensor in buffers.items():  # the very same memory
        assert after[key].data_ptr() == tensor.data_ptr() and torch.equal(after[key], tensor)
    assert torch.equal(target(kjt).values(), before)
    fresh = CompressedEmbeddingBagCollection(TABLES)
    with pytest.raises(RuntimeError, match=rf"t_mid\.{buffer}\b"):
        fresh.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="has no table"):  # still an empty placeholder
        fresh(kjt)


@pytest.mark.parametrize("chunk_bits", [0, 5, 128])
def test_a_bad_chunk_width_in_meta_fails_the_load(mixed, chunk_bits: int) -> None:
    _, ours = mixed
    state = dict(ours.state_dict())
    meta = state["embedding_bags.t_mid.meta"].clone()
    meta[2] = chunk_bits
    state["embedding_bags.t_mid.meta"] = meta
    fresh = CompressedEmbeddingBagCollection(TABLES)
    with pytest.raises(RuntimeError, match=r"t_mid\.meta: chunk_bits must be 16, 32 or 64"):
        fresh.load_state_dict(state)
    assert fresh.embedding_bags["t_mid"].chunk_bits == 0


def test_a_bad_slot_unit_in_meta_is_reported_as_meta(mixed) -> None:
    _, ours = mixed
    state = dict(ours.state_dict())
    meta = state["embedding_bags.t_mid.meta"].clone()
    meta[3] = 3  # unit_bytes: not a power of two
    state["embedding_bags.t_mid.meta"] = meta
    with pytest.raises(RuntimeError, match=r"t_mid\.meta: unit_bytes 3 is not a valid slot unit"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(state)


def test_an_index_that_disagrees_with_its_rows_fails_the_load(mixed) -> None:
    """Right sizes and dtypes, wrong contents: the loader's index checks catch it."""
    _, ours = mixed
    state = dict(ours.state_dict())
    block_base = state["embedding_bags.t_mid.block_base"].clone()
    block_base[1] += 1
    state["embedding_bags.t_mid.block_base"] = block_base
    with pytest.raises(RuntimeError, match=r"t_mid\.block_base: block offsets disagree"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(state)


@pytest.mark.skipif(cuda_kernels_missing() is not None, reason=cuda_kernels_missing() or "")
def test_a_gpu_modules_state_dict_is_checked_and_loads() -> None:
    ebc = make_ebc(TABLES)
    state = CompressedEmbeddingBagCollection.from_ebc(ebc).cuda().state_dict()
    # The index moves to the GPU, the payload stays in (pinned) host memory: the check covers both.
    assert state["embedding_bags.t_mid.block_base"].is_cuda
    assert not state["embedding_bags.t_mid.payload"].is_cuda
    fresh = CompressedEmbeddingBagCollection(TABLES)
    fresh.load_state_dict(state)
    kjt = random_kjt(ebc, 16, 5, seed=3)
    got = fresh.cuda()(kjt.to(torch.device("cuda")))
    diff = (got.values().cpu().double() - ebc(kjt).values().detach().double()).abs()
    assert bool((diff <= pooled_error_bound(ebc, kjt)).all())
    bad = _tampered(state, "embedding_bags.t_mid.row_units", "truncated")
    with pytest.raises(RuntimeError, match=r"t_mid\.row_units must have"):
        CompressedEmbeddingBagCollection(TABLES).load_state_dict(bad)


# -- packed table sets ---------------------------------------------------------------------------


def test_from_table_set(tmp_path) -> None:
    tables = [
        EmbeddingBagConfig(
            name="zeta", embedding_dim=6, num_embeddings=90, feature_names=["z1", "z2"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="alpha", embedding_dim=3, num_embeddings=40, feature_names=["a"]),
    ]  # fmt: skip
    ebc = make_ebc(tables)
    pack_table_set(tmp_path, from_torchrec(ebc))
    ours = CompressedEmbeddingBagCollection.from_table_set(tmp_path, tables=["zeta", "alpha"])
    assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 16, 5, seed=0))
    assert ours.embedding_bag_configs()[0].pooling == PoolingType.MEAN
    default = CompressedEmbeddingBagCollection.from_table_set(tmp_path)
    assert [c.name for c in default.embedding_bag_configs()] == ["alpha", "zeta"]
    with pytest.raises(KeyError, match="table 'nope' is not in the table set"):
        CompressedEmbeddingBagCollection.from_table_set(tmp_path, tables=["nope"])


def test_from_table_set_reads_the_features_mapped_to_a_state_dicts_tables(tmp_path) -> None:
    # A state dict holds no feature names: `ibpembed pack --feature F=T` maps them, and the
    # collection reads them as the server serves them, not the tables' own names.
    tables = [
        EmbeddingBagConfig(
            name="t_two", embedding_dim=5, num_embeddings=40, feature_names=["f_a", "f_b"]
        ),
        EmbeddingBagConfig(name="t_one", embedding_dim=3, num_embeddings=30, feature_names=["f_c"]),
    ]
    ebc = make_ebc(tables)
    torch.save(torch.nn.ModuleDict({"sparse": ebc}).state_dict(), tmp_path / "model.pt")
    features = [f"--feature={f}={c.name}" for c in tables for f in c.feature_names]
    argv = ["pack", str(tmp_path / "model.pt"), "-o", str(tmp_path / "set"), "--no-progress"]
    assert main_cli([*argv, *features]) == 0
    ours = CompressedEmbeddingBagCollection.from_table_set(
        tmp_path / "set", tables=["t_two", "t_one"]
    )
    assert [c.feature_names for c in ours.embedding_bag_configs()] == [["f_a", "f_b"], ["f_c"]]
    assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 16, 5, seed=0))


def test_from_table_set_refuses_a_row_shard(tmp_path) -> None:
    """A shard's file holds global rows [start, end): read as a table of its own, id 0 would
    return row `start`. Refused, naming the way that serves shards."""
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    argv = ["pack", str(tmp_path / "t.npy"), "-o", str(tmp_path / "set"), "--no-progress"]
    assert main_cli([*argv, "--shards", "2"]) == 0
    for k, rows in enumerate(["[0, 5) of 10", "[5, 10) of 10"]):
        with pytest.raises(
            ValueError,
            match=rf"table 't' of .*shard-{k}-of-2 is a row shard \(rows {re.escape(rows)}\)",
        ) as info:
            CompressedEmbeddingBagCollection.from_table_set(tmp_path / "set" / f"shard-{k}-of-2")
        assert "RemoteEmbeddingBagCollection.from_server" in str(info.value)


def test_from_table_set_reads_what_the_manifest_maps_as_the_server_does(tmp_path) -> None:
    """A merge that maps table a's only feature to table b leaves a reachable by no lookup:
    the server answers feature 'a' from b, and so does the collection, which leaves a out."""
    a, b = np.full((6, 2), 1.0, np.float32), np.full((6, 2), 2.0, np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "set"
    argv = ["-o", str(out), "--no-progress"]
    assert main_cli(["pack", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), *argv]) == 0
    assert main_cli(["pack", str(tmp_path / "b.npy"), *argv, "--merge", "--feature", "a=b"]) == 0
    with TableStore.load(out).acquire() as snap:
        assert snap.table_for_feature("a")[0] == "b"
    ours = CompressedEmbeddingBagCollection.from_table_set(out)
    assert [(c.name, c.feature_names) for c in ours.embedding_bag_configs()] == [("b", ["a"])]
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([0, 5]), lengths=torch.tensor([2]))
    got = ours(kjt)
    assert got.keys() == ["a"] and torch.equal(got.values(), torch.tensor([[4.0, 4.0]]))
    with pytest.raises(ValueError, match=r"table 'a' of .*: no feature maps to it"):
        CompressedEmbeddingBagCollection.from_table_set(out, tables=["a", "b"])


def test_from_table_set_bf16_and_int8(tmp_path) -> None:
    torch.manual_seed(0)
    bf16 = (torch.randn(50, 8) * 0.1).bfloat16()
    sources = (
        TableSource("b", bf16, feature_names=("b",), pooling="mean"),
        TableSource("q", torch.randint(0, 255, (20, 8), dtype=torch.uint8)),
    )
    pack_table_set(tmp_path, TableSet(sources))
    ours = CompressedEmbeddingBagCollection.from_table_set(tmp_path, tables=["b"])
    # bf16 -> fp32 is exact, so an fp32 EBC holding the same values is the reference.
    config = replace(ours.embedding_bag_configs()[0], data_type=DataType.FP32)
    ebc = EmbeddingBagCollection(tables=[config])
    with torch.no_grad():
        ebc.embedding_bags["b"].weight.copy_(bf16.float())
    assert_same_as_torchrec(ebc, ours, random_kjt(ebc, 16, 5, seed=1))
    with pytest.raises(ValueError, match="table 'q' holds uint8 rows"):
        CompressedEmbeddingBagCollection.from_table_set(tmp_path)


# -- compress_model --------------------------------------------------------------------------------


class TwoTower(torch.nn.Module):
    """Several collections: a direct attribute and two inside a ModuleList, one weighted."""

    def __init__(self) -> None:
        super().__init__()
        self.user = make_ebc(TABLES, seed=1)
        item = EmbeddingBagConfig(name="i", embedding_dim=8, num_embeddings=64, feature_names=["i"])
        cat = EmbeddingBagConfig(
            name="c", embedding_dim=4, num_embeddings=5000, feature_names=["c"]
        )
        self.towers = torch.nn.ModuleList(
            [
                make_ebc([item], is_weighted=True, seed=2),
                torch.nn.Linear(2, 2),
                make_ebc([cat], seed=3),
            ]
        )

    def forward(self, user, item, cat) -> torch.Tensor:
        return torch.cat(
            [self.user(user).values(), self.towers[0](item).values(), self.towers[2](cat).values()],
            dim=1,
        )


def test_compress_model_swaps_every_collection() -> None:
    model = TwoTower()
    sources = [model.user, model.towers[0], model.towers[2]]
    inputs = (
        random_kjt(model.user, 8, 4, seed=0),
        random_kjt(model.towers[0], 8, 4, seed=1, weighted=True),
        random_kjt(model.towers[2], 8, 4, seed=2),
    )
    with torch.no_grad():
        before = model(*inputs)
    report = compress_model(model)
    assert isinstance(model.user, CompressedEmbeddingBagCollection)
    assert isinstance(model.towers[0], CompressedEmbeddingBagCollection)
    assert isinstance(model.towers[1], torch.nn.Linear)
    assert isinstance(model.towers[2], CompressedEmbeddingBagCollection)
    assert model.towers[0].is_weighted()
    swapped = [model.user, model.towers[0], model.towers[2]]
    for source, new, kjt in zip(sources, swapped, inputs, strict=True):
        assert_same_as_torchrec(source, new, kjt)
    with torch.no_grad():
        after = model(*inputs)
    assert after.shape == before.shape

    assert [(r.module, r.table) for r in report] == [
        ("user", "t_small"), ("user", "t_wide"), ("user", "t_one"), ("user", "t_mid"),
        ("towers.0", "i"), ("towers.2", "c"),
    ]  # fmt: skip
    for r, source in zip(report, [swapped[0]] * 4 + swapped[1:], strict=True):
        table = source.embedding_bags[r.table].compressed_table()
        assert r.raw_bytes == r.num_embeddings * r.embedding_dim * 4
        assert r.stored_bytes == table.stored_bytes
    text = format_table_bytes(report)
    assert "towers.2.c" in text and "5000x4" in text and text.splitlines()[-1].startswith("total")


def test_compress_model_replaces_a_shared_collection_at_every_path() -> None:
    ebc = make_ebc(TABLES)
    model = torch.nn.Module()
    model.a = ebc
    model.tower = torch.nn.Sequential(torch.nn.Identity(), ebc)  # the same module, twice more
    model.b = ebc
    report = compress_model(model)
    compressed = model.a
    assert isinstance(compressed, CompressedEmbeddingBagCollection)
    assert model.b is compressed and model.tower[1] is compressed  # one module, not copies
    assert not any(isinstance(m, EmbeddingBagCollection) for m in model.modules())
    # Its tables are stored once: reported once, under the first path.
    assert [(r.module, r.table) for r in report] == [("a", c.name) for c in TABLES]
    assert_same_as_torchrec(ebc, model.b, random_kjt(ebc, 8, 4, seed=0))


def test_compress_model_changes_nothing_when_a_collection_fails() -> None:
    model = torch.nn.Module()
    model.first = first = make_ebc(TABLES)
    model.second = second = make_ebc(TABLES[:1]).double()  # float64 rows cannot be compressed
    with pytest.raises(TypeError, match=r"table 't_small': weights are torch\.float64"):
        compress_model(model)
    assert model.first is first and model.second is second


def test_compress_model_errors() -> None:
    with pytest.raises(TypeError, match="from_ebc"):
        compress_model(make_ebc(TABLES))
    with pytest.raises(ValueError, match="holds no torchrec EmbeddingBagCollection"):
        compress_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# -- TorchScript and torch.compile -----------------------------------------------------------------


def test_torch_jit_script(mixed) -> None:
    ebc, ours = mixed
    scripted = torch.jit.script(ours)
    kjt = random_kjt(ebc, 8, 4, seed=4)
    torch.testing.assert_close(scripted(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
    assert scripted(kjt).keys() == ours(kjt).keys()
    # A scripted module saves and loads with its compressed buffers.
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    torch.testing.assert_close(loaded(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
    # The checks survive scripting; they run inside the collection's op, whose Python error
    # TorchScript re-raises as a RuntimeError naming the original exception.
    with pytest.raises(RuntimeError, match=r"IndexError: feature 'f_c' \(table 't_one'\)"):
        scripted(batch_with(f_c=[3]))


class Head(torch.nn.Module):
    """A model around the collection, as torchrec's inference flow traces it."""

    def __init__(self, sparse: torch.nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        self.linear = torch.nn.Linear(3 + 129 + 129 + 1 + 16, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(self.sparse(features).values())


def test_fx_trace_into_the_collection_then_script(mixed) -> None:
    ebc, ours = mixed
    model = Head(ours)
    kjt = random_kjt(ebc, 8, 4, seed=5)
    with torch.no_grad():
        expected = model(kjt)
        # torchrec's tracer enters the collection: the key checks are one wrapped call and the
        # lookups one op, so nothing branches on a proxy.
        traced = symbolic_trace(model)
        targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
        assert "ibpembed.pooled_collection" in targets
        torch.testing.assert_close(traced(kjt), expected, rtol=0, atol=0)
        scripted = torch.jit.script(traced)
        torch.testing.assert_close(scripted(kjt), expected, rtol=0, atol=0)
        # Tracing it as a leaf, as torchrec does for sharded modules, works as well.
        leaf = symbolic_trace(model, leaf_modules=["CompressedEmbeddingBagCollection"])
        torch.testing.assert_close(torch.jit.script(leaf)(kjt), expected, rtol=0, atol=0)


def test_torch_compile_with_graph_breaks(mixed) -> None:
    ebc, ours = mixed
    torch._dynamo.reset()
    # aot_eager runs the ops' fake kernels without needing a C++ toolchain for inductor.
    compiled = torch.compile(ours, backend="aot_eager")
    kjt = random_kjt(ebc, 8, 4, seed=0)
    with torch.no_grad():  # inference graphs: no backward to trace
        torch.testing.assert_close(compiled(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
        with pytest.raises(IndexError, match="table 't_one'"):
            compiled(batch_with(f_c=[3]))


def test_torch_compile_fullgraph_and_export(mixed) -> None:
    ebc, ours = mixed
    torch._dynamo.reset()
    kjt = random_kjt(ebc, 8, 4, seed=6)
    with torch.no_grad():
        expected = ours(kjt).values()
        # One graph: the data-dependent checks run inside the op, its fake kernel gives the shape.
        compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(kjt).values(), expected, rtol=0, atol=0)
        with pytest.raises(IndexError, match="table 't_one'"):
            compiled(batch_with(f_c=[3]))
        torch._dynamo.reset()
        exported = torch.export.export(ours, (kjt,), strict=False)
        torch.testing.assert_close(exported.module()(kjt).values(), expected, rtol=0, atol=0)


def test_hot_rows_keep_outputs_and_stay_out_of_the_state_dict() -> None:
    ebc = make_ebc(TABLES)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    traffic = [random_kjt(ebc, 64, 9, seed=s) for s in range(4)]
    kjt = random_kjt(ebc, 32, 9, seed=11)
    before = ours(kjt).values()
    cached = ours.cache_hot_rows(traffic, budget=0.5)
    assert cached["t_mid"] > 0 and cached["t_wide"] > 0
    assert all(b.hot_ids.numel() == cached[n] for n, b in ours.embedding_bags.items())
    hot_bytes = {r.table: r.hot_bytes for r in ours.table_bytes()}
    assert hot_bytes["t_mid"] >= cached["t_mid"] * 16 * 4
    # Same rows in the same order: the same bits, through eager and scripted forwards.
    assert torch.equal(ours(kjt).values(), before)
    assert torch.equal(torch.jit.script(ours)(kjt).values(), before)
    assert_same_as_torchrec(ebc, ours, kjt)
    state = ours.state_dict()
    assert not any("hot_" in key for key in state)
    # Loading a state dict replaces the rows, so the copies of the old rows must go.
    other = make_ebc(TABLES, seed=5)
    ours.load_state_dict(CompressedEmbeddingBagCollection.from_ebc(other).state_dict())
    assert all(b.hot_ids.numel() == 0 for b in ours.embedding_bags.values())
    assert_same_as_torchrec(other, ours, kjt)
    assert ours.cache_hot_rows(traffic, budget=0.0) == dict.fromkeys(cached, 0)
    with pytest.raises(ValueError, match="budget"):
        ours.cache_hot_rows(traffic, budget=2.0)


def test_hot_row_budgets_take_the_servers_spellings() -> None:
    ebc = make_ebc(TABLES)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    traffic = [random_kjt(ebc, 64, 9, seed=s) for s in range(4)]
    kjt = random_kjt(ebc, 32, 9, seed=11)
    before = ours(kjt).values()

    # "savings": the largest tier that keeps each table within its raw bytes (none for the tiny
    # tables that compression makes larger).
    cached = ours.cache_hot_rows(traffic, budget="savings")
    assert cached["t_wide"] > 0 and cached["t_mid"] > 0 and cached["t_small"] == 0
    for r in ours.table_bytes():
        assert r.hot_bytes == 0 or r.stored_bytes + r.hot_bytes <= r.raw_bytes, r
    assert torch.equal(ours(kjt).values(), before)
    # A share written as a percentage is the float share.
    assert ours.cache_hot_rows(traffic, budget="50%") == ours.cache_hot_rows(traffic, budget=0.5)
    # "all": every row, sampled or not, and no directory; a table stored all raw is read as
    # such a tier already and gets no copy.
    cached = ours.cache_hot_rows(traffic, budget="all")
    for name, bag in ours.embedding_bags.items():
        every = bag.num_embeddings if bag.compressed_table().compressed_rows else 0
        assert cached[name] == every and bag.hot_dir.numel() == 0, name
    assert torch.equal(ours(kjt).values(), before)
    assert set(ours.cache_hot_rows(traffic, budget="off").values()) == {0}
    for bad in ("0.05", "-1%", "lots", 2.0, True):
        with pytest.raises(ValueError, match="budget"):
            ours.cache_hot_rows(traffic, budget=bad)


def test_hot_rows_are_what_the_forward_reads() -> None:
    """Tampered copies change the output: the test above cannot pass with copies ignored."""
    ebc = make_ebc(TABLES)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    bag = ours.embedding_bags["t_mid"]
    assert bag.set_hot_rows(torch.arange(1000)) > 0
    bag.hot_rows = torch.zeros_like(bag.hot_rows)
    weight = ebc.embedding_bags["t_mid"].weight.detach()
    hot = int(bag.hot_ids[weight[bag.hot_ids].ne(0).any(dim=1)][0])  # a row that is not zero
    kjt = KeyedJaggedTensor(
        keys=["f_a", "f_b", "f_c", "f_shared"],
        values=torch.tensor([hot, hot]),
        lengths=torch.tensor([0, 0, 0, 2]),
    )
    values = ours(kjt)["f_shared@t_mid"]
    assert bool((values == 0).all()) and bool(ebc(kjt)["f_shared@t_mid"].ne(0).any())


@pytest.mark.skipif(cuda_kernels_missing() is not None, reason=cuda_kernels_missing() or "")
def test_on_a_gpu_the_rows_stay_in_pinned_host_memory() -> None:
    ebc = make_ebc(TABLES)
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc).cuda()
    for bag in ours.embedding_bags.values():
        assert bag.payload.device.type == "cpu" and bag.payload.is_pinned()
        assert bag.block_base.is_cuda and bag.bitval.is_cuda and bag.meta.is_cuda
    kjt = random_kjt(ebc, 16, 5, seed=3)
    got = ours(kjt.to(torch.device("cuda")))
    expected = ebc(kjt)
    diff = (got.values().cpu().double() - expected.values().detach().double()).abs()
    assert bool((diff <= pooled_error_bound(ebc, kjt)).all())
    back = ours.cpu()
    assert all(bag.block_base.device.type == "cpu" for bag in back.embedding_bags.values())
    assert_same_as_torchrec(ebc, back, kjt)
