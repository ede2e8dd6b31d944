# SPDX-License-Identifier: Apache-2.0
"""Importers on real torchrec / fbgemm objects and real file formats, through pack and load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed import compress
from ibpembed.tables import importers
from ibpembed.tables.importers import SourceError, TableSet, TableSource
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from tests.tables.helpers import mapped_from, same_bits, trained_like

torchrec = pytest.importorskip("torchrec")
fbgemm_inference = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_inference")
from fbgemm_gpu.split_embedding_configs import SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation  # noqa: E402


def make_ebc(device: str = "cpu") -> torch.nn.Module:
    tables = [
        torchrec.EmbeddingBagConfig(
            name="t_user",
            embedding_dim=16,
            num_embeddings=300,
            feature_names=["user_id", "friend_id"],
            pooling=torchrec.PoolingType.SUM,
        ),
        torchrec.EmbeddingBagConfig(
            name="t_item",
            embedding_dim=8,
            num_embeddings=77,
            feature_names=["item_id"],
            pooling=torchrec.PoolingType.MEAN,
        ),
    ]
    return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device(device))


def roundtrip(tmp_path: Path, table_set: TableSet) -> TableStore:
    pack_table_set(tmp_path / "set", table_set)
    return TableStore.load(tmp_path / "set", verify=True)


# -- torchrec --------------------------------------------------------------------------------


def test_torchrec_ebc_module_roundtrip_and_pooling(tmp_path: Path) -> None:
    ebc = make_ebc()
    table_set = importers.from_torchrec(ebc)
    assert [s.name for s in table_set.tables] == ["t_user", "t_item"]
    assert table_set.features() == {"user_id": "t_user", "friend_id": "t_user", "item_id": "t_item"}
    assert [s.pooling for s in table_set.tables] == ["sum", "mean"]
    store = roundtrip(tmp_path, table_set)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "friend_id", "item_id"],
        values=torch.tensor([1, 2, 299, 0, 5, 7, 76, 3]),
        lengths=torch.tensor([2, 1, 0, 1, 2, 2]),  # B = 2 per feature, one empty bag
    )
    expected = ebc(kjt).to_dict()
    with store.acquire() as snap:
        assert same_bits(snap.tables["t_user"].decompress(), ebc.embedding_bags["t_user"].weight)
        for feature in ("user_id", "friend_id", "item_id"):
            name, table = snap.table_for_feature(feature)
            jt = kjt[feature]
            pooling = "mean" if name == "t_item" else "sum"
            got = table.lookup(jt.values(), lengths=jt.lengths(), pooling=pooling)
            torch.testing.assert_close(got, expected[feature].detach(), rtol=1e-6, atol=1e-6)


def test_torchrec_model_with_nested_collection(tmp_path: Path) -> None:
    model = torch.nn.Sequential()
    model.add_module("sparse", make_ebc())
    model.add_module("dense", torch.nn.Linear(4, 4))
    table_set = importers.from_torchrec(model)
    assert {s.name for s in table_set.tables} == {"t_user", "t_item"}
    with pytest.raises(SourceError, match="no torchrec EmbeddingBagCollection"):
        importers.from_torchrec(torch.nn.Linear(2, 2))


def test_torchrec_state_dict_checks_shapes_against_configs() -> None:
    ebc = make_ebc()
    state = ebc.state_dict()
    configs = ebc.embedding_bag_configs()
    table_set = importers.from_torchrec_state_dict(state, configs)
    assert same_bits(table_set.tables[1].weight, ebc.embedding_bags["t_item"].weight.detach())
    state["embedding_bags.t_item.weight"] = torch.zeros(70, 8)
    with pytest.raises(SourceError, match=r"'t_item' weight has shape \(70, 8\).*\[77, 8\]"):
        importers.from_torchrec_state_dict(state, configs)
    del state["embedding_bags.t_item.weight"]
    with pytest.raises(SourceError, match="'t_item' has no weight"):
        importers.from_torchrec_state_dict(state, configs)


def test_torchrec_meta_device_is_refused() -> None:
    with pytest.raises(SourceError, match="meta device"):
        importers.from_torchrec(make_ebc("meta"))


def test_torchrec_quantized_collection_matches_its_forward(tmp_path: Path) -> None:
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    ebc = make_ebc()
    ebc.qconfig = torch.ao.quantization.QConfig(
        activation=torch.ao.quantization.PlaceholderObserver,
        weight=torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    quantized = QuantEBC.from_float(ebc)
    table_set = importers.from_torchrec(quantized)
    assert [(s.name, s.quant, s.pooling) for s in table_set.tables] == [
        ("t_user", "int8_rowwise", "sum"),
        ("t_item", "int8_rowwise", "mean"),
    ]
    assert table_set.features()["friend_id"] == "t_user"
    store = roundtrip(tmp_path, table_set)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "friend_id", "item_id"],
        values=torch.tensor([1, 2, 299, 0, 5, 7, 76, 3]),
        lengths=torch.tensor([2, 1, 0, 1, 2, 2]),
    )
    expected = quantized(kjt).to_dict()
    with store.acquire() as snap:
        for feature in ("user_id", "friend_id", "item_id"):
            name, table = snap.table_for_feature(feature)
            jt = kjt[feature]
            pooling = "mean" if name == "t_item" else "sum"
            got = table.lookup(jt.values(), lengths=jt.lengths(), pooling=pooling)
            torch.testing.assert_close(got, expected[feature].float(), rtol=1e-3, atol=1e-3)


def test_torchrec_checkpoint_file(tmp_path: Path) -> None:
    ebc = make_ebc()
    torch.save({"model": ebc.state_dict(), "step": torch.tensor(3)}, tmp_path / "ckpt.pt")
    table_set = importers.load_sources([tmp_path / "ckpt.pt"])
    assert {s.name for s in table_set.tables} == {"t_user", "t_item"}
    store = roundtrip(tmp_path, table_set)
    with store.acquire() as snap:
        assert same_bits(snap.tables["t_user"].decompress(), ebc.embedding_bags["t_user"].weight)


# -- fbgemm ----------------------------------------------------------------------------------


def make_tbe() -> torch.nn.Module:
    specs = [
        ("t8", 100, 16, SparseType.INT8, EmbeddingLocation.HOST),
        ("t4", 60, 32, SparseType.INT4, EmbeddingLocation.HOST),
        ("t16", 50, 6, SparseType.FP16, EmbeddingLocation.HOST),
        ("t32", 40, 3, SparseType.FP32, EmbeddingLocation.HOST),
    ]
    tbe = fbgemm_inference.IntNBitTableBatchedEmbeddingBagsCodegen(specs, device="cpu")
    tbe.fill_random_weights()
    return tbe


def test_fbgemm_rows_are_kept_as_stored(tmp_path: Path) -> None:
    tbe = make_tbe()
    table_set = importers.from_fbgemm(tbe)
    weights = tbe.split_embedding_weights()
    by_name = {s.name: s for s in table_set.tables}
    int8, int4, fp16, fp32 = (by_name[n] for n in ("t8", "t4", "t16", "t32"))
    assert int8.quant == "int8_rowwise" and int8.weight.shape == (100, 4 + 16)
    assert torch.equal(int8.weight, torch.cat([weights[0][1], weights[0][0]], 1))
    assert int4.layout == "fbgemm_int4_rowwise" and int4.weight.shape == (60, 4 + 16)
    assert torch.equal(int4.weight, torch.cat([weights[1][1], weights[1][0][:, :16]], 1))
    assert fp16.weight.dtype == torch.float16 and fp16.weight.shape == (50, 6)
    assert torch.equal(fp16.weight.view(torch.uint8), weights[2][0][:, :12])
    assert fp32.weight.dtype == torch.float32 and fp32.weight.shape == (40, 3)
    store = roundtrip(tmp_path, table_set)
    with store.acquire() as snap:
        for source in table_set.tables:
            assert same_bits(snap.tables[source.name].decompress(), source.weight)
        assert snap.tables["t8"].quant == "int8_rowwise"


def test_fbgemm_int8_pooled_lookup_matches_fbgemm() -> None:
    specs = [("t8", 100, 16, SparseType.INT8, EmbeddingLocation.HOST)]
    tbe = fbgemm_inference.IntNBitTableBatchedEmbeddingBagsCodegen(specs, device="cpu")
    tbe.fill_random_weights()
    source = importers.from_fbgemm(tbe).tables[0]
    table = compress(source.weight, quant="int8_rowwise")
    ids = torch.tensor([1, 5, 7, 99, 3, 3])
    offsets = torch.tensor([0, 2, 2, 6])
    expected = tbe(ids.int(), offsets.int()).float()  # fbgemm returns fp16 here
    got = table.lookup(ids, offsets=offsets)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_fbgemm_names_must_match_table_count() -> None:
    with pytest.raises(SourceError, match="2 names for 4 tables"):
        importers.from_fbgemm(make_tbe(), ["a", "b"])


# -- files -----------------------------------------------------------------------------------


def test_npy_is_memory_mapped(tmp_path: Path) -> None:
    array = trained_like(120, 10, torch.float16).numpy()
    np.save(tmp_path / "emb.npy", array)
    table_set = importers.from_npy(tmp_path / "emb.npy")
    source = table_set.tables[0]
    assert source.name == "emb"
    assert mapped_from(source.weight.data_ptr()) == str(tmp_path / "emb.npy")
    assert same_bits(source.weight, torch.from_numpy(array))


def test_npy_rejects_bad_arrays(tmp_path: Path) -> None:
    np.save(tmp_path / "one_d.npy", np.zeros(5, np.float32))
    with pytest.raises(SourceError, match="2-D"):
        importers.from_npy(tmp_path / "one_d.npy")
    np.save(tmp_path / "f64.npy", np.zeros((3, 3), np.float64))
    with pytest.raises(SourceError, match=r"unsupported table dtype torch\.float64"):
        importers.from_npy(tmp_path / "f64.npy")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_npy_in_the_other_byte_order_is_swapped_losslessly(tmp_path: Path, dtype) -> None:
    gen = np.random.default_rng(0)
    native = (gen.standard_normal((40, 6)) * 0.1).astype(dtype)
    bits = native.view(np.uint16 if dtype == np.float16 else np.uint32)
    bits[0, :3] = [0x7E01, 0xFE55, 0x8000] if dtype == np.float16 else [0x7FC00001, 0xFFA0BEEF, 0]
    np.save(tmp_path / "big.npy", native.byteswap().view(native.dtype.newbyteorder(">")))
    assert np.load(tmp_path / "big.npy").dtype.byteorder == ">"
    source = importers.from_npy(tmp_path / "big.npy").tables[0]
    assert same_bits(source.weight, torch.from_numpy(native))  # NaN payloads, -0.0 included
    store = roundtrip(tmp_path, importers.load_sources([tmp_path / "big.npy"]))
    with store.acquire() as snap:
        assert same_bits(snap.tables["big"].decompress(), torch.from_numpy(native))


def test_load_sources_selects_tables_before_checking_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    emb = trained_like(64, 8)
    torch.save({"emb": emb, "pos_ids": torch.arange(20).reshape(2, 10)}, src / "model.pt")
    torch.save(torch.zeros(3, 3, dtype=torch.int64), src / "steps.pt")  # a lone bad tensor
    np.save(src / "counts.npy", np.zeros((4, 4), np.int64))
    np.save(src / "item.npy", trained_like(10, 4).numpy())
    with pytest.raises(SourceError, match=r"unsupported table dtype torch\.int64"):
        importers.load_sources([src])
    table_set = importers.load_sources([src], tables=["item", "emb"])
    assert [s.name for s in table_set.tables] == ["item", "emb"]  # in the order asked for
    assert same_bits(table_set.tables[1].weight, emb)
    with pytest.raises(SourceError, match=r"no table named \['nope'\]"):
        importers.load_sources([src], tables=["emb", "nope"])
    with pytest.raises(SourceError, match="table 'pos_ids': unsupported table dtype"):
        importers.load_sources([src], tables=["pos_ids"])  # chosen, then checked


def test_safetensors_bf16(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {
        "a.weight": trained_like(64, 8, torch.bfloat16),
        "b.weight": trained_like(10, 4),
        "bias": torch.zeros(4),
    }
    save_file(weights, str(tmp_path / "m.safetensors"))
    table_set = importers.from_safetensors(tmp_path / "m.safetensors")
    assert {s.name for s in table_set.tables} == {"a.weight", "b.weight"}  # 2-D only
    only = importers.from_safetensors(tmp_path / "m.safetensors", keys=["a.weight"])
    store = roundtrip(tmp_path, only)
    with store.acquire() as snap:
        assert same_bits(snap.tables["a.weight"].decompress(), weights["a.weight"])


def test_pt_tensor_and_directory_of_sources(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    torch.save(trained_like(33, 5), src / "alpha.pt")
    np.save(src / "beta.npy", trained_like(20, 3).numpy())
    (src / "notes.txt").write_text("ignored")
    table_set = importers.load_sources([src])
    assert [s.name for s in table_set.tables] == ["alpha", "beta"]
    store = roundtrip(tmp_path, table_set)
    with store.acquire() as snap:
        assert same_bits(snap.tables["alpha"].decompress(), trained_like(33, 5))


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda p: importers.load_sources([p / "missing.pt"]), "no such file"),
        (lambda p: importers.from_state_dict({"w": torch.zeros(4)}), "no 2-D tensors"),
        (lambda p: importers.from_state_dict({"w": torch.zeros(4)}, keys=["w"]), "must be 2-D"),
        (lambda p: importers.from_state_dict({"w": torch.zeros(2, 2)}, keys=["v"]), "no entries"),
        (
            lambda p: importers.from_tensor(torch.zeros(3, 3, dtype=torch.int64)),
            "unsupported table dtype",
        ),
        (
            lambda p: TableSet(
                (TableSource("a", torch.zeros(2, 2)), TableSource("a", torch.zeros(2, 2)))
            ),
            "appears twice",
        ),
        (
            lambda p: TableSet(
                (
                    TableSource("a", torch.zeros(2, 2), feature_names=("f",)),
                    TableSource("b", torch.zeros(2, 2), feature_names=("f",)),
                )
            ),
            "feature 'f' is mapped to both",
        ),
        (
            lambda p: TableSet((TableSource("a", torch.zeros(2, 2)),), {"f": "zz"}),
            r"maps to table 'zz', which is not among the tables packed \['a'\]",
        ),
    ],
)
def test_bad_sources_are_refused_before_packing(tmp_path: Path, build, error: str) -> None:
    with pytest.raises(SourceError, match=error):
        build(tmp_path)


def test_pt_file_that_is_not_weights(tmp_path: Path) -> None:
    (tmp_path / "bad.pt").write_bytes(b"not a zip")
    with pytest.raises(SourceError, match=r"cannot load with torch\.load"):
        importers.from_pt(tmp_path / "bad.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(SourceError, match="holds a list"):
        importers.from_pt(tmp_path / "list.pt")
