# SPDX-License-Identifier: Apache-2.0
"""Same-host shared-memory regions: outputs (and inputs) through real POSIX shm with a real
server on loopback, bit-identical to the same request over TCP, and every bad input refused with
a status naming the field while the server keeps serving."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid

import grpc
import numpy as np
import pytest

from ibpembed.server.metrics import ServerMetrics
from ibpembed.server.regions import VALUE_ALIGN
from ibpembed.server.wire import region_response_bytes
from ibpembed_client import (
    AsyncLookupClient,
    FeatureBatch,
    LookupClient,
    LookupServiceError,
    OutputRegion,
    RetryPolicy,
    SharedMemoryRegion,
    build_request,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from tests.engine.helpers import FEATURES, GateObserver, RecordingObserver, make_store
from tests.metrics.helpers import fetch, parse, value

from .helpers import RunningServer
from .test_security import _tls, pki  # noqa: F401 (pki is a fixture)

MB = 1 << 20


@pytest.fixture(scope="module")
def store():
    return make_store()


@pytest.fixture(scope="module")
def observer():
    return RecordingObserver()


@pytest.fixture(scope="module")
def server(store, observer):
    with RunningServer(store, observer=observer) as running:
        yield running


@pytest.fixture()
def client(server):
    with LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as c:
        yield c
        c.unregister_region()


@pytest.fixture()
def shm():
    with SharedMemoryRegion.create(f"/ibpembed-test-{uuid.uuid4().hex[:12]}", 4 * MB) as memory:
        yield memory


def _features(store, seed: int, batch: int, weighted: bool = False, names=None):
    rng = np.random.default_rng(seed)
    out = {}
    with store.acquire() as snap:
        for name in names or FEATURES:
            rows = snap.tables[FEATURES[name]].num_rows
            lengths = rng.integers(0, 5, batch).astype(np.int32)
            ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
            weights = rng.uniform(-1, 2, ids.size).astype(np.float32) if weighted else None
            out[name] = FeatureBatch(ids, lengths, weights)
    return out


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("pooling", ["none", "sum", "mean"])
@pytest.mark.parametrize("batch", [0, 1, 37])
def test_region_outputs_are_bit_identical_to_tcp(client, store, shm, pooling, batch):
    features = _features(store, batch, batch, weighted=pooling != "none")
    if pooling != "none":
        features.pop("quant")  # int8 rows pool too, but weights-free here keeps it simple
    client.register_region("out", shm)
    over_tcp = client.lookup(features, pooling)
    over_shm = client.lookup(features, pooling, output_region="out")
    for name in features:
        got = over_shm[name]
        assert _same_bits(got, over_tcp[name])
        assert over_shm.dtypes[name] == over_tcp.dtypes[name]
        # A view of the region, not a copy: it aliases the client's mapping.
        assert not got.flags.owndata
        if got.size:
            assert np.shares_memory(got, shm.array(0, np.uint8, (shm.size,)))


def test_region_values_are_aligned_and_the_response_carries_no_values(server, client, store, shm):
    client.register_region("out", shm, offset=4096, byte_size=MB)
    request = build_request(_features(store, 3, 5), "sum", output_region="out")
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))
    response = stub.Lookup(request, timeout=30)
    assert response.features and all(not f.values for f in response.features)
    assert [f.region_offset % VALUE_ALIGN for f in response.features] == [0] * len(
        response.features
    )
    assert all(f.shape[0] == 5 for f in response.features)


def test_stream_writes_into_regions_bit_identical_to_tcp(client, store, shm):
    client.register_region("out", shm)
    per_request = MB
    requests, tcp = [], []
    for i, pooling in enumerate(["none", "sum", "mean", "sum"]):
        features = _features(store, 50 + i, 16, names=["user", "item", "ctx"])
        window = OutputRegion("out", offset=i * per_request, byte_size=per_request)
        requests.append(build_request(features, pooling, output_region=window))
        tcp.append(client.lookup(features, pooling))
    results = list(client.lookup_stream(requests))
    for got, want in zip(results, tcp, strict=True):
        for name, values in want.items():
            assert _same_bits(got[name], values)


def test_inputs_from_a_region(client, store, shm):
    features = _features(store, 9, 21, weighted=True, names=["user", "user_hist", "ctx"])
    names = list(features)
    ids = np.concatenate([features[n].ids for n in names])
    lengths = np.concatenate([features[n].lengths for n in names])
    weights = np.concatenate([features[n].weights for n in names])
    # Registered first: a registration writes its nonce at the region's first bytes.
    client.register_region("in", shm, byte_size=MB)
    client.register_region("out", shm, offset=MB, byte_size=MB)
    end = shm.write(0, ids)
    end = shm.write(end, lengths)
    shm.write(end, weights)
    request = pb.LookupRequest(pooling=pb.POOLING_SUM)
    for name in names:
        request.features.add(name=name)
    request.input_region.name = "in"
    request.input_region.num_ids.extend(features[n].ids.size for n in names)
    request.input_region.batch_sizes.extend(features[n].lengths.size for n in names)
    request.input_region.weighted = True
    request.output_region.name = "out"
    got = client.lookup_request(request)
    want = client.lookup(features, "sum")
    for name in names:
        assert _same_bits(got[name], want[name])


@pytest.mark.parametrize("ending", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
def test_a_call_that_ended_leaves_its_window_to_the_next_lookup(store, shm, ending):
    """A lookup held in its kernels past its call's end (deadline, or the client cancelling)
    finishes after the caller's next lookup into the same window, and must not overwrite it."""
    gate = GateObserver(holds=1)
    with (
        RunningServer(store, observer=gate) as running,
        LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as client,
        grpc.insecure_channel(running.target) as channel,
    ):
        client.register_region("out", shm)
        ended = build_request({"user": [[1]]}, "sum", output_region="out")
        stub = lookup_pb2_grpc.EmbeddingLookupStub(channel)
        if ending == grpc.StatusCode.DEADLINE_EXCEEDED:
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(ended, timeout=0.2)
            assert err.value.code() == ending
        else:
            call = stub.Lookup.future(ended, timeout=30)
            gate.wait_entered(1)
            call.cancel()
        # The server's own end of the call, which may come a little after the client's.
        until = time.monotonic() + 10
        while ("Lookup", ending.name) not in gate.rpcs and time.monotonic() < until:
            time.sleep(0.01)
        assert ("Lookup", ending.name) in gate.rpcs
        following = client.lookup({"user": [[2]]}, "sum", output_region="out")
        want = client.lookup({"user": [[2]]}, "sum")
        gate.open()
        running.run(_idle(running))  # the held lookup has finished
        assert _same_bits(following["user"], want["user"])


async def _idle(running: RunningServer) -> None:
    while running.server.engine.inflight:
        await asyncio.sleep(0.01)


def test_concurrent_requests_write_disjoint_parts_of_one_region(client, store, shm):
    client.register_region("out", shm)
    slice_bytes = 256 * 1024
    jobs = [(_features(store, 200 + k, 32, names=["user", "item"]), k) for k in range(12)]

    def one(job):
        features, k = job
        window = OutputRegion("out", offset=k * slice_bytes, byte_size=slice_bytes)
        return client.lookup(features, "sum", output_region=window)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, jobs))
    for (features, _), result in zip(jobs, results, strict=True):
        want = client.lookup(features, "sum")  # over TCP, after every region write
        for name in features:
            assert _same_bits(result[name], want[name])


def test_list_and_unregister(client, shm):
    client.register_region("a", shm, byte_size=1024)
    client.register_region("b", shm, offset=1024, byte_size=2048)
    listed = {(r.name, r.shm_name, r.offset, r.byte_size) for r in client.list_regions()}
    assert listed == {("a", shm.shm_name, 0, 1024), ("b", shm.shm_name, 1024, 2048)}
    assert client.unregister_region("a") == 1
    assert [r.name for r in client.list_regions()] == ["b"]
    with pytest.raises(LookupServiceError) as err:
        client.unregister_region("a")
    assert _code(err) == grpc.StatusCode.NOT_FOUND
    assert client.unregister_region() == 1
    assert client.list_regions() == []


# -- bad input -------------------------------------------------------------------------------


def _register(server, token: str | None = None, **fields) -> None:
    """RegisterRegion through the raw stub, with the nonce written into the object where this
    process can write it (as the client library does)."""
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    request = pb.RegisterRegionRequest(**fields)
    challenge = pb.ChallengeRegionRequest(shm_name=request.shm_name, offset=request.offset)
    if request.kind != pb.REGION_KIND_CUDA_IPC and request.shm_name.startswith("/"):
        request.nonce = stub.ChallengeRegion(challenge, timeout=30, metadata=metadata).nonce
        path = "/dev/shm" + request.shm_name
        if "/" not in request.shm_name[1:] and os.path.isfile(path) and not os.path.islink(path):
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_size >= request.offset + len(request.nonce):
                    os.pwrite(fd, request.nonce, request.offset)
            finally:
                os.close(fd)
    stub.RegisterRegion(request, timeout=30, metadata=metadata)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"shm_name": "no-slash"}, grpc.StatusCode.INVALID_ARGUMENT, "shm_name"),
        ({"shm_name": "/a/b"}, grpc.StatusCode.INVALID_ARGUMENT, "shm_name"),
        ({"shm_name": "/.."}, grpc.StatusCode.INVALID_ARGUMENT, "shm_name"),
        ({"shm_name": "/" + "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "shm_name"),
        ({"shm_name": "/ibpembed-missing-zz"}, grpc.StatusCode.NOT_FOUND, "shm_name"),
        ({"byte_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "byte_size"),
        ({"byte_size": 5 * MB}, grpc.StatusCode.INVALID_ARGUMENT, "byte_size"),
        ({"offset": 4 * MB, "byte_size": 1}, grpc.StatusCode.INVALID_ARGUMENT, "byte_size"),
        ({"name": ""}, grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ({"kind": pb.REGION_KIND_CUDA_IPC}, grpc.StatusCode.UNIMPLEMENTED, "kind"),
        ({"kind": 77}, grpc.StatusCode.INVALID_ARGUMENT, "kind"),
    ],
)
def test_bad_registrations(server, shm, fields, code, field):
    request = {"name": "r", "shm_name": shm.shm_name, "byte_size": 1024} | fields
    with pytest.raises(grpc.RpcError) as err:
        _register(server, **request)
    assert err.value.code() == code
    assert err.value.details().startswith(field)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        assert "GPU" in err.value.details()


def test_a_registration_refused_for_its_arguments_keeps_its_nonce(server, shm):
    """Arguments are checked before the nonce is spent: a region too small to hold the nonce is
    INVALID_ARGUMENT, and the same nonce then registers the region at its right size."""
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))
    challenge = pb.ChallengeRegionRequest(shm_name=shm.shm_name, offset=0)
    nonce = stub.ChallengeRegion(challenge, timeout=30).nonce
    shm.write(0, np.frombuffer(nonce, np.uint8))
    request = pb.RegisterRegionRequest(name="kept-nonce", shm_name=shm.shm_name, nonce=nonce)
    request.byte_size = len(nonce) - 1
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterRegion(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("byte_size")
    request.byte_size = 1024
    stub.RegisterRegion(request, timeout=30)
    listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=30).regions
    assert [(r.name, r.byte_size) for r in listed] == [("kept-nonce", 1024)]
    stub.UnregisterRegion(pb.UnregisterRegionRequest(name="kept-nonce"), timeout=30)


def test_a_symlink_is_not_a_region(server, shm, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(4096))
    link = f"/ibpembed-link-{uuid.uuid4().hex[:8]}"
    os.symlink(target, "/dev/shm" + link)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _register(server, name="r", shm_name=link, byte_size=1024)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert target.read_bytes() == bytes(4096)
    finally:
        os.unlink("/dev/shm" + link)


def test_a_name_registered_twice(client, server, shm):
    client.register_region("dup", shm, byte_size=1024)
    with pytest.raises(LookupServiceError) as err:
        client.register_region("dup", shm, byte_size=1024)
    assert _code(err) == grpc.StatusCode.ALREADY_EXISTS
    # A server without tokens cannot tell callers apart: a made-up authorization header is
    # the same anonymous caller, not a new one with a name space and quota of its own.
    with pytest.raises(grpc.RpcError) as other:
        _register(server, token="someone-else", name="dup", shm_name=shm.shm_name, byte_size=64)
    assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text("# identity token\nalice alice-secret\nbob bob-secret\n")
    return path


@pytest.fixture(scope="module")
def token_server(store, tokens_file):
    with RunningServer(store, auth_tokens_file=str(tokens_file)) as running:
        yield running


@pytest.fixture()
def alice_and_bob(token_server):
    """Clients of ``token_server`` as two identities (see ``tokens_file``); a test that takes
    ``shm`` first closes them before its region goes."""
    with (
        LookupClient(token_server.target, timeout=30, token="alice-secret") as alice,
        LookupClient(token_server.target, timeout=30, token="bob-secret") as bob,
    ):
        yield alice, bob


def test_another_callers_region(shm, alice_and_bob, store):
    alice, bob = alice_and_bob
    alice.register_region("alices", shm)
    bob._regions["alices"] = alice._regions["alices"]  # bob names it anyway
    features = _features(store, 1, 2, names=["user"])
    # Another identity's region does not exist for bob: he cannot use, release or even
    # learn of its name.
    with pytest.raises(LookupServiceError) as err:
        bob.lookup(features, "sum", output_region="alices")
    assert _code(err) == grpc.StatusCode.NOT_FOUND
    assert "output_region.name" in err.value.details
    with pytest.raises(LookupServiceError) as err:
        bob.unregister_region("alices")
    assert _code(err) == grpc.StatusCode.NOT_FOUND
    assert bob.list_regions() == []
    assert [r.name for r in alice.list_regions()] == ["alices"]
    assert alice.unregister_region() == 1


def test_identities_name_their_regions_apart(shm, alice_and_bob, store):
    """Each identity has a namespace of its own: no caller can take a name another needs."""
    alice, bob = alice_and_bob
    alice.register_region("out", shm)
    bob.register_region("out", shm)  # the same name, bob's own region
    features = _features(store, 2, 3, names=["user"])
    expected = alice.lookup(features, "sum")["user"]
    for client in (alice, bob):
        got = client.lookup(features, "sum", output_region="out")["user"]
        assert np.array_equal(got, expected)
    assert bob.unregister_region("out") == 1
    assert [r.name for r in alice.list_regions()] == ["out"]  # alice's is untouched
    assert alice.unregister_region() == 1


def _lookup_error(server, features, pooling="sum", **region) -> grpc.RpcError:
    request = build_request(features, pooling)
    request.output_region.CopyFrom(pb.OutputRegion(**region))
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(request, timeout=30)
    return err.value


def test_bad_output_regions(server, client, store, shm):
    client.register_region("out", shm, offset=MB, byte_size=MB)
    features = _features(store, 4, 64, names=["user", "item"])
    cases = [
        ({"name": "nope"}, grpc.StatusCode.NOT_FOUND, "output_region.name"),
        (
            {"name": "out", "offset": MB + 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_region.offset",
        ),
        (
            {"name": "out", "offset": MB - 8, "byte_size": 16},
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_region.byte_size",
        ),
        (  # the window is inside the region but too small for the result
            {"name": "out", "byte_size": 256},
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_region.byte_size",
        ),
    ]
    before = shm.array(MB, np.uint8, (MB,)).copy()
    for region, code, field in cases:
        err = _lookup_error(server, features, **region)
        assert err.code() == code, region
        assert err.details().startswith(field), err.details()
    # Nothing was written for any of them (a too-small window fails before the first byte).
    assert np.array_equal(shm.array(MB, np.uint8, (MB,)), before)


def test_a_region_shrunk_or_unlinked_under_it(server, store):
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    memory = SharedMemoryRegion.create(name, MB)
    features = _features(store, 5, 8, names=["user", "ctx"])
    with LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as c:
        c.register_region("fragile", memory)
        c.lookup(features, "sum", output_region="fragile")
        os.truncate("/dev/shm" + name, 4096)  # shrunk below the registered region
        with pytest.raises(LookupServiceError) as err:
            c.lookup(features, "sum", output_region="fragile")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "shrank" in err.value.details and "output_region.name" in err.value.details
        os.truncate("/dev/shm" + name, MB)
        c.lookup(features, "sum", output_region="fragile")
        os.unlink("/dev/shm" + name)
        with pytest.raises(LookupServiceError) as err:
            c.lookup(features, "sum", output_region="fragile")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert "unlinked" in err.value.details
        assert c.unregister_region("fragile") == 1
        assert c.lookup(features, "sum")["user"].shape == (8, 16)  # still serving
    memory.owner = False  # already unlinked
    memory.close()


def test_truncation_racing_live_writes_never_crashes_the_server(server, store):
    """A region truncated and restored in a tight loop while lookups write into it: each lookup
    succeeds or fails with a status (the server writes with pwritev, never through a mapping
    that a truncation would turn into SIGBUS)."""
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    path = "/dev/shm" + name
    # No client mapping: this process's own reads would fault on the truncations, not the
    # server's (which maps nothing).
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    os.truncate(path, MB)
    features = _features(store, 6, 64, names=["user", "user_hist", "item"])
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            os.truncate(path, 0)
            os.truncate(path, MB)

    flapper = threading.Thread(target=flap)
    try:
        with LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as c:
            stub = lookup_pb2_grpc.EmbeddingLookupStub(c._channel(c.target))
            _register(server, name="flap", shm_name=name, byte_size=MB)
            flapper.start()
            request = build_request(features, "sum", output_region="flap")
            codes = set()
            for _ in range(200):
                try:
                    stub.Lookup(request, timeout=30)
                    codes.add(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.add(err.code())
            stop.set()
            flapper.join()
            assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
            assert c.lookup(features, "sum")["user"].shape == (64, 16)
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name="flap"), timeout=30)
    finally:
        stop.set()
        if flapper.is_alive():
            flapper.join()
        os.unlink(path)


def test_region_bytes_are_counted_apart_from_wire_bytes(client, store, shm, observer):
    client.register_region("out", shm)
    features = _features(store, 8, 10, names=["user"])
    observer.outputs.clear()
    observer.wire.clear()
    client.lookup(features, "sum")
    client.lookup(features, "sum", output_region="out")
    (wire, sent), (shm_, written) = observer.outputs
    assert (wire, shm_, written) == ("wire", "shm", 10 * 16 * 4)
    assert 10 * 16 * 4 < sent < 10 * 16 * 4 + 64  # the values and their framing
    # Writing into the region is the request's encode, as building the response is.
    assert [phase for phase, _ in observer.wire] == ["decode", "encode"] * 2


def _open_by_this_process(path: str) -> int:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return links.count(path)


def test_server_stop_releases_regions(store, shm):
    """The in-process server's descriptors are this process's: one per region until the stop."""
    running = RunningServer(store)
    path = "/dev/shm" + shm.shm_name
    mine = _open_by_this_process(path)  # Python's mmap keeps a descriptor of its own
    with LookupClient(running.target, timeout=30) as c:
        c.register_region("r1", shm)
        c.register_region("r2", shm, offset=MB)
        assert _open_by_this_process(path) == mine + 2
        c.unregister_region("r1")
        assert _open_by_this_process(path) == mine + 1
    running.stop()
    assert _open_by_this_process(path) == mine


def test_regions_over_tls_with_token_auth(store, shm, pki, tmp_path):  # noqa: F811
    """With auth on, a region is its token's; the stream and unary paths both write into it."""
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    settings = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "auth_token_file": str(token_file),
    }
    features = _features(store, 12, 6, names=["user", "item"])
    with (
        RunningServer(store, **settings) as running,
        LookupClient(running.target, tls=_tls(pki), token="t0ken", timeout=30) as c,
    ):
        c.register_region("secure", shm)
        want = c.lookup(features, "sum")
        got = c.lookup(features, "sum", output_region="secure")
        streamed = list(
            c.lookup_stream(
                [build_request(features, "sum", output_region=OutputRegion("secure", MB, MB))]
            )
        )
        for name in features:
            assert _same_bits(got[name], want[name])
            assert _same_bits(streamed[0][name], want[name])
        with LookupClient(running.target, tls=_tls(pki), timeout=30) as anonymous:
            with pytest.raises(LookupServiceError) as err:
                anonymous.list_regions()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_bad_input_regions(server, client, store, shm):
    features = _features(store, 13, 3, names=["user", "ctx"])
    client.register_region("in", shm, byte_size=4096)
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))

    def request(**spec) -> pb.LookupRequest:
        r = build_request(features, "sum")
        for f in r.features:
            f.ClearField("ids")
            f.ClearField("lengths")
        r.input_region.CopyFrom(pb.InputRegion(name="in", **spec))
        return r

    bad = [
        (request(num_ids=[1], batch_sizes=[1, 1]), "input_region.num_ids"),
        (request(num_ids=[-1, 2], batch_sizes=[1, 1]), "input_region.num_ids"),
        (request(num_ids=[400, 400], batch_sizes=[1, 1]), "input_region.offset"),
        (request(offset=5000, num_ids=[1, 1], batch_sizes=[1, 1]), "input_region.offset"),
        (build_request(features, "sum"), "features[0]"),  # bytes and a region both
    ]
    bad[-1][0].input_region.CopyFrom(pb.InputRegion(name="in", num_ids=[1, 1], batch_sizes=[1, 1]))
    weighted_none = request(num_ids=[1, 1], batch_sizes=[1, 1], weighted=True)
    weighted_none.pooling = pb.POOLING_NONE
    bad.append((weighted_none, "input_region.weighted"))
    for message, field in bad:
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(message, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    missing = request(num_ids=[1, 1], batch_sizes=[1, 1])
    missing.input_region.name = "absent"
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(missing, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_inputs_read_from_a_region_are_bound_by_the_message_limit(store, shm):
    """As the same ids sent in the request would be: refused before anything is read."""
    with (
        RunningServer(store, max_message_mb=1) as running,
        LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as client,
    ):
        client.register_region("in", shm)

        def request(ids: int) -> pb.LookupRequest:
            r = pb.LookupRequest(pooling=pb.POOLING_SUM, features=[pb.FeatureInput(name="user")])
            r.input_region.CopyFrom(pb.InputRegion(name="in", num_ids=[ids], batch_sizes=[1]))
            return r

        shm.write(0, np.full(200_000, 7, np.int64))
        shm.write(200_000 * 8, np.array([200_000], np.int32))
        with pytest.raises(LookupServiceError) as err:
            client.lookup_request(request(200_000))  # 1,600,004 bytes, in the 4 MB region
        assert _code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details.startswith("input_region.num_ids")
        assert "1600004 bytes" in err.value.details and "--max-message-mb" in err.value.details
        shm.write(100_000 * 8, np.array([100_000], np.int32))
        pooled = client.lookup_request(request(100_000))["user"]  # 800,004 bytes: fine
        want = client.lookup({"user": [[7] * 100_000]})["user"]
        assert _same_bits(pooled, want)


def test_async_client_regions_and_output_dtype(server, store, shm):
    features = _features(store, 14, 9, names=["user", "ctx"])

    async def main() -> None:
        async with AsyncLookupClient(server.target, timeout=30) as c:
            await c.register_region("async", shm)
            want = await c.lookup(features, "mean")
            got = await c.lookup(features, "mean", output_region="async")
            half = await c.lookup(features, "mean", output_dtype="float16")
            moved = await c.lookup(features, "mean", input_region="async", input_offset=2 * MB)

            async def requests():
                yield build_request(features, "mean", output_region=OutputRegion("async", MB))

            streamed = [r async for r in c.lookup_stream(requests())]
            for name in features:
                assert _same_bits(got[name], want[name])
                assert _same_bits(streamed[0][name], want[name])
                assert np.array_equal(half[name], want[name].astype(np.float16))
                assert _same_bits(moved[name], want[name])
            assert [r.name for r in await c.list_regions()] == ["async"]
            assert await c.unregister_region() == 1

    asyncio.run(main())


@pytest.mark.parametrize("request_id", ["", "r-1"])
def test_region_response_bytes_are_protobufs(request_id):
    """The hand-written region response is exactly what protobuf serializes for it."""
    features = [("a", pb.DTYPE_FLOAT32, (3, 16), 0), ("bb", pb.DTYPE_BFLOAT16, (0, 8), 192)]
    features.append(("c" * 200, pb.DTYPE_FLOAT16, (70000, 3), 1 << 40))
    wire = region_response_bytes(request_id, 7, features)
    want = pb.LookupResponse(request_id=request_id, table_version=7)
    for name, dtype, shape, offset in features:
        want.features.add(name=name, dtype=dtype, shape=shape, region_offset=offset)
    assert wire == want.SerializeToString()


def test_shared_memory_results_are_not_bound_by_the_message_size(store, shm):
    """A server whose messages are capped at 1 MB writes a bigger result into a region; the
    window, not the message limit, bounds it (and is checked before any lookup work)."""
    rng = np.random.default_rng(15)
    batch = 20_000  # [20000, 16] fp32 = 1.28 MB
    features = {
        "user": FeatureBatch(
            rng.integers(0, 1000, batch).astype(np.int64), np.ones(batch, np.int32)
        )
    }
    with (
        RunningServer(store, max_message_mb=1) as running,
        LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as c,
    ):
        with pytest.raises(LookupServiceError) as err:
            c.lookup(features, "sum")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        c.register_region("big", shm)
        got = c.lookup(features, "sum", output_region="big")
        assert got["user"].shape == (batch, 16)
        # A window holding exactly the bf16 result is enough for it.
        exact = OutputRegion("big", offset=0, byte_size=batch * 16 * 2)
        half = c.lookup(features, "sum", output_dtype="bfloat16", output_region=exact)
        assert half["user"].shape == (batch, 16)
        with pytest.raises(LookupServiceError) as err:
            c.lookup(features, "sum", output_region=OutputRegion("big", 0, batch * 16 * 4 - 1))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith("output_region.byte_size")


def test_output_bytes_are_exported_by_transport(store, shm):
    metrics = ServerMetrics(store, device="cpu")
    features = _features(store, 16, 10, names=["user"])
    with RunningServer(store, observer=metrics) as running:
        port = metrics.start_http_server("127.0.0.1", 0)
        try:
            with LookupClient(running.target, timeout=30) as c:
                c.register_region("m", shm)
                c.lookup(features, "sum", output_region="m")
                c.lookup(features, "sum", output_region="m")
                c.lookup(features, "sum")
            samples = parse(fetch(f"http://127.0.0.1:{port}/metrics"))
        finally:
            metrics.stop_http_server()
    assert value(samples, "ibpembed_output_bytes_total", transport="shm") == 2 * 10 * 16 * 4
    assert value(samples, "ibpembed_output_bytes_total", transport="wire") > 10 * 16 * 4


def test_client_moves_inputs_into_a_region(client, store, shm):
    features = _features(store, 17, 12, weighted=True, names=["user", "item", "ctx"])
    features["user_hist"] = _features(store, 18, 5, names=["user_hist"])["user_hist"]  # unweighted
    client.register_region("io", shm)
    want = client.lookup(features, "sum")
    got = client.lookup(
        features, "sum", input_region="io", input_offset=MB, output_region=OutputRegion("io", 0, MB)
    )
    for name in features:
        assert _same_bits(got[name], want[name])
    with pytest.raises(ValueError, match="past the end"):
        client.lookup(features, "sum", input_region="io", input_offset=4 * MB - 16)
