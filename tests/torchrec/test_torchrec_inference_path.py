# SPDX-License-Identifier: Apache-2.0
"""CompressedEmbeddingBagCollection in torchrec's inference path.

First torchrec's own ``EmbeddingBagCollection`` test scenarios (torchrec/modules/tests/
test_embedding_modules.py: unweighted, shared tables, shared features, weighted), each run on
torchrec's module and on the compressed one, eager, through ``torchrec.fx.symbolic_trace`` and
then ``torch.jit.script``: identical keys and offsets, values within the fp32 bound. Then a
torchrec ``DLRM`` holding the compressed collection through ``torch.export.export`` (dynamic
batch and nnz, saved and loaded) and ``torch.compile(fullgraph=True)``.
"""

import io

import pytest

pytest.importorskip("torchrec.models.dlrm", reason="torchrec is not installed")

import torch
from torch.export import Dim
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.fx import symbolic_trace
from torchrec.models.dlrm import DLRM

from ibpembed.torchrec import CompressedEmbeddingBagCollection, pooled_error_bound


def assert_like_torchrec(ebc: EmbeddingBagCollection, ours, kjt: KeyedJaggedTensor) -> None:
    expected, got = ebc(kjt), ours(kjt)
    assert got.keys() == expected.keys()
    assert got.length_per_key() == expected.length_per_key()
    assert got.offset_per_key() == expected.offset_per_key()
    assert got.values().shape == expected.values().shape
    diff = (got.values().double() - expected.values().detach().double()).abs()
    assert bool((diff <= pooled_error_bound(ebc, kjt)).all())


def run_scenario(ebc: EmbeddingBagCollection, kjt: KeyedJaggedTensor, keys: list[str]) -> None:
    ours = CompressedEmbeddingBagCollection.from_ebc(ebc)
    with torch.no_grad():
        assert ours(kjt).keys() == keys
        assert_like_torchrec(ebc, ours, kjt)
        # torchrec's flow for inference models: FX-trace, then script; both modules alike.
        for module in (ebc, ours):
            traced = symbolic_trace(module)
            scripted = torch.jit.script(traced)
            for runnable in (traced, scripted):
                out = runnable(kjt)
                assert out.keys() == keys
                torch.testing.assert_close(out.values(), module(kjt).values(), rtol=0, atol=0)
        assert_like_torchrec(ebc, torch.jit.script(symbolic_trace(ours)), kjt)


def test_unweighted() -> None:
    # torchrec's test_unweighted: two tables, one feature each.
    eb1 = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    eb2 = EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])
    ebc = EmbeddingBagCollection(tables=[eb1, eb2])
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        offsets=torch.tensor([0, 2, 4, 6, 9]),
    )
    run_scenario(ebc, kjt, ["f1", "f2"])
    assert CompressedEmbeddingBagCollection.from_ebc(ebc)(kjt).offset_per_key() == [0, 4, 8]


def test_shared_tables() -> None:
    # One table read by two features.
    eb1 = EmbeddingBagConfig(
        name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]
    )
    ebc = EmbeddingBagCollection(tables=[eb1])
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"],
        values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]),
        offsets=torch.tensor([0, 2, 4, 6, 9]),
    )
    run_scenario(ebc, kjt, ["f1", "f2"])


def test_shared_features() -> None:
    # One feature read by two tables: torchrec names the outputs feature@table.
    eb1 = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    eb2 = EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=10, feature_names=["f1"])
    ebc = EmbeddingBagCollection(tables=[eb1, eb2])
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]), offsets=torch.tensor([0, 9])
    )
    run_scenario(ebc, kjt, ["f1@t1", "f1@t2"])
    assert CompressedEmbeddingBagCollection.from_ebc(ebc)(kjt).offset_per_key() == [0, 4, 12]


def test_weighted() -> None:
    eb1 = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    eb2 = EmbeddingBagConfig(name="t2", embedding_dim=5, num_embeddings=10, feature_names=["f2"])
    ebc = EmbeddingBagCollection(tables=[eb1, eb2], is_weighted=True)
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"],
        values=torch.tensor([1, 3, 0, 2, 4, 5, 6, 7, 9]),
        offsets=torch.tensor([0, 2, 2, 3, 9]),
        weights=torch.tensor([0.5, 1.0, 2.0, -1.5, 3.0, 0.25, 1.0, 4.0, 0.5]),
    )
    run_scenario(ebc, kjt, ["f1", "f2"])


# -- a DLRM holding the compressed collection: export and one-graph compile -------------------

FEATURES = ["f0", "f1", "f2"]


def dlrm_model() -> DLRM:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f])
        for i, f in enumerate(FEATURES)
    ]
    ebc = CompressedEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=tables))
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
    ).eval()


def batch(size: int, seed: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=gen)
    lengths[0] = 0  # an empty bag
    ids = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
    dense = torch.randn(size, 4, generator=gen)
    return dense, KeyedJaggedTensor(keys=FEATURES, values=ids, lengths=lengths)


def test_torch_export_of_a_dlrm_runs_with_the_ops_loaded() -> None:
    model = dlrm_model()
    size, nnz = Dim("batch", min=2), Dim("nnz", min=2)
    # KeyedJaggedTensor flattens to (values, weights, lengths, offsets, stride_per_key_per_rank,
    # inverse_indices): nnz ids and len(FEATURES) x batch lengths.
    kjt_shapes = [{0: nnz}, None, {0: len(FEATURES) * size}, None, None, None]
    with torch.no_grad():
        exported = torch.export.export(
            model, batch(5, 0), dynamic_shapes=({0: size}, kjt_shapes), strict=False
        )
        ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
        assert "ibpembed.pooled_collection.default" in ops
        buffer = io.BytesIO()
        torch.export.save(exported, buffer)
        buffer.seek(0)
        # The saved example inputs hold a KeyedJaggedTensor, which torch.load's weights-only
        # unpickler refuses unless it is allowed.
        with torch.serialization.safe_globals([KeyedJaggedTensor]):
            loaded = torch.export.load(buffer)
        # Other batch sizes and id counts than the example's.
        for program in (exported, loaded):
            for b, seed in ((5, 1), (9, 2), (2, 3)):
                dense, kjt = batch(b, seed)
                torch.testing.assert_close(
                    program.module()(dense, kjt), model(dense, kjt), rtol=0, atol=0
                )
        # The op's checks hold in the exported program too.
        bad = KeyedJaggedTensor(
            keys=FEATURES,
            values=torch.tensor([1, 2, 100]),
            lengths=torch.tensor([1, 1, 1, 0, 0, 0]),
        )
        with pytest.raises(IndexError, match=r"feature 'f1' \(table 't1'\): id 100"):
            loaded.module()(torch.randn(2, 4), bad)


def test_torch_compile_fullgraph_of_a_dlrm() -> None:
    model = dlrm_model()
    torch._dynamo.reset()
    # aot_eager runs the ops' fake kernels (no C++ toolchain needed, unlike inductor).
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for b, seed in ((5, 0), (7, 1), (3, 2)):
            dense, kjt = batch(b, seed)
            torch.testing.assert_close(compiled(dense, kjt), model(dense, kjt), rtol=0, atol=0)


def test_opcheck_of_the_collection_op(monkeypatch: pytest.MonkeyPatch) -> None:
    # Schema, fake kernel (shape, dtype, device against the real op), dispatcher registration
    # and the dynamic-shape AOT path, on the arguments a real forward passes.
    model = dlrm_model()
    op = torch.ops.ibpembed.pooled_collection.default
    captured: list[tuple] = []

    def capture(*args):
        captured.append(args)
        return op(*args)

    monkeypatch.setattr(torch.ops.ibpembed, "pooled_collection", capture)
    with torch.no_grad():
        model(*batch(6, 4))
    monkeypatch.undo()
    (args,) = captured
    torch.library.opcheck(op, args)
