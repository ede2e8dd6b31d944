# SPDX-License-Identifier: Apache-2.0
"""Security checks against a real ``ibpembed serve`` with TLS and a bearer token.

    python -m reliability.security [--json PATH]

The server runs with ``--tls-cert/--tls-key`` and ``--auth-token-file`` at log level debug (the
most it ever writes). Checked:

* every ``ibpembed.v1`` method without a token, and with wrong tokens (other value, a prefix, a
  longer one, wrong scheme or case, no scheme, empty), is UNAUTHENTICATED; the right one is OK;
* a client trusting another CA fails the TLS handshake (UNAVAILABLE, nothing served), and so
  does a plaintext client;
* with mTLS, a client without a certificate fails the handshake;
* health answers without a token (Kubernetes probes send none); reflection, like every
  non-health service, needs the token;
* an empty token file stops ``serve`` at start-up with a message, not a server that accepts all;
* the token and the private keys appear nowhere in the server's output, the client's error
  messages or the load generator's JSON report.

Isolation and overload, against plaintext servers (without tokens, and with a tokens file):

* another process's shm object (mode 0600) cannot be registered, read or written by a caller in
  a process of its own with another user's rights (it cannot write the server's nonce into it),
  with and without a token of its own; a refusal of region inputs quotes no byte of the region;
* made-up ``authorization`` headers on a server without tokens are one identity with one quota;
  identities of a tokens file share ``--max-regions``;
* a fresh client is served while eight LookupStreams nobody reads stay open, and the write
  timeout ends those streams;
* the server's RSS across refused 60 MiB requests; a request naming a million features is
  refused in milliseconds, with health answering meanwhile;
* a served table file truncated in place is withdrawn and the server lives; a manifest nested
  100,000 deep is rejected once; ``input_region`` counts past int64 are INVALID_ARGUMENT, and
  inputs in a region larger than the message limit are RESOURCE_EXHAUSTED before any is read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST, read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed_client import (
    LookupClient,
    LookupServiceError,
    RetryPolicy,
    SharedMemoryRegion,
    TlsOptions,
    build_request,
    loadgen,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from reliability.common import make_pki
from tools.hostile import SECRET, feature_names_request, victim_object
from tools.serve_process import IBPEMBED, REPO, ServerProcess

TOKEN = "s3cret-Token-6f1d2c"  # what must never be printed
WRONG_AUTHORIZATION = {
    "no token": None,
    "other token": "Bearer not-the-token",
    "prefix of the token": f"Bearer {TOKEN[:-1]}",
    "token plus a byte": f"Bearer {TOKEN}x",
    "lowercase scheme": f"bearer {TOKEN}",
    "no scheme": TOKEN,
    "other scheme": f"Basic {TOKEN}",
    "empty bearer": "Bearer ",
}
NO_RETRY = RetryPolicy(max_attempts=1)


def _methods(stub: lookup_pb2_grpc.EmbeddingLookupStub) -> dict[str, Callable]:
    """Each ibpembed.v1 method as a call taking metadata."""
    request = pb.LookupRequest(features=[pb.FeatureInput(name="cat_0")])
    return {
        "Lookup": lambda md: stub.Lookup(request, metadata=md, timeout=30),
        "LookupStream": lambda md: list(
            stub.LookupStream(iter([request]), metadata=md, timeout=30)
        ),
        "ListTables": lambda md: stub.ListTables(pb.ListTablesRequest(), metadata=md, timeout=30),
        "DescribeTable": lambda md: stub.DescribeTable(
            pb.DescribeTableRequest(name="cat_0"), metadata=md, timeout=30
        ),
    }


def _code(call: Callable, metadata: tuple) -> str:
    try:
        call(metadata)
    except grpc.RpcError as err:
        return err.code().name
    return "OK"


def check_tokens(channel: grpc.Channel) -> tuple[dict, list[str]]:
    stub = lookup_pb2_grpc.EmbeddingLookupStub(channel)
    results, failures = {}, []
    for label, value in {**WRONG_AUTHORIZATION, "right token": f"Bearer {TOKEN}"}.items():
        metadata = () if value is None else (("authorization", value),)
        codes = {name: _code(call, metadata) for name, call in _methods(stub).items()}
        results[label] = codes
        want = "OK" if label == "right token" else "UNAUTHENTICATED"
        wrong = {m: c for m, c in codes.items() if c != want}
        if wrong:
            failures.append(f"{label}: {wrong}")
    return results, failures


def check_probes(channel: grpc.Channel) -> tuple[dict, list[str]]:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    serving = health.status == health_pb2.HealthCheckResponse.SERVING
    try:
        ProtoReflectionDescriptorDatabase(channel).get_services()
        anonymous_reflection = "OK"
    except grpc.RpcError as err:
        anonymous_reflection = err.code().name
    results = {
        "health_without_token": "SERVING" if serving else "NOT SERVING",
        "reflection_without_token": anonymous_reflection,
    }
    failures = []
    if not serving:
        failures.append("health is not reachable without a token")
    if anonymous_reflection != "UNAUTHENTICATED":
        failures.append(f"reflection without a token: {anonymous_reflection}")
    return results, failures


def check_reflection_with_token(target: str, tls: TlsOptions) -> tuple[dict, list[str]]:
    token_md = ("authorization", f"Bearer {TOKEN}")

    class AddToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        def _with(self, details):
            return details._replace(metadata=[*(details.metadata or ()), token_md])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with(details), request)

        def intercept_stream_stream(self, continuation, details, requests):
            return continuation(self._with(details), requests)

    channel = grpc.intercept_channel(grpc.secure_channel(target, tls.credentials()), AddToken())
    with channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    ok = "ibpembed.v1.EmbeddingLookup" in services
    return {"reflection_with_token": sorted(services)}, [] if ok else ["reflection with token"]


def check_tls(target: str, pki: Path, tls: TlsOptions) -> tuple[dict, list[str]]:
    results, failures = {}, []
    rogue = TlsOptions(root_certificates=(pki / "rogue.crt").read_bytes())
    for label, options in (("client trusting another CA", rogue), ("plaintext client", None)):
        client = LookupClient(target, tls=options, token=TOKEN, timeout=10, retry=NO_RETRY)
        try:
            client.lookup({"cat_0": [[0]]})
            results[label] = "OK"
        except LookupServiceError as err:
            results[label] = err.code.name
            if TOKEN in str(err) or TOKEN in repr(err):
                failures.append(f"{label}: the error message holds the token")
        finally:
            client.close()
        if results[label] != "UNAVAILABLE":
            failures.append(f"{label}: {results[label]} (expected a failed handshake)")
    with LookupClient(target, tls=tls, token=TOKEN, timeout=30) as good:
        good.lookup({"cat_0": [[0]]})  # raises unless OK
    results["right CA and token"] = "OK"
    return results, failures


def check_mtls(pki: Path, token_file: Path) -> tuple[dict, list[str]]:
    flags = [
        "--tls-cert",
        str(pki / "server.crt"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-client-ca",
        str(pki / "ca.crt"),
        "--auth-token-file",
        str(token_file),
        "--demo-max-rows",
        "100",
        "--device",
        "cpu",
    ]
    results, failures = {}, []
    with ServerProcess(*flags) as server:
        ca = (pki / "ca.crt").read_bytes()
        cases = {
            "no client certificate": TlsOptions(ca),
            "client certificate from the CA": TlsOptions(
                ca, (pki / "client.key").read_bytes(), (pki / "client.crt").read_bytes()
            ),
        }
        for label, options in cases.items():
            client = LookupClient(
                server.target, tls=options, token=TOKEN, timeout=10, retry=NO_RETRY
            )
            try:
                client.lookup({"cat_0": [[0]]})
                results[label] = "OK"
            except LookupServiceError as err:
                results[label] = err.code.name
            finally:
                client.close()
        log = server.log()
    if results["no client certificate"] != "UNAVAILABLE":
        failures.append(f"mTLS without a client certificate: {results['no client certificate']}")
    if results["client certificate from the CA"] != "OK":
        failures.append("mTLS with a good client certificate failed")
    return {**results, "log": log}, failures


def check_empty_token_file(work: Path) -> tuple[dict, list[str]]:
    empty = work / "empty_token"
    empty.write_text("  \n")
    proc = subprocess.run(
        [
            *IBPEMBED,
            "serve",
            "--port",
            "0",
            "--auth-token-file",
            str(empty),
            "--demo-max-rows",
            "100",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    ok = proc.returncode != 0 and "Traceback" not in proc.stderr
    failures = [] if ok else [f"empty token file: exit {proc.returncode}: {proc.stderr[-300:]}"]
    return {"exit_code": proc.returncode, "message": message}, failures


def secrets_in(text: str, pki: Path) -> list[str]:
    """Which secrets (the token, a private key's body) occur in ``text``."""
    found = [] if TOKEN not in text else ["token"]
    for key in ("server.key", "client.key", "ca.key"):
        body = "".join((pki / key).read_text().splitlines()[1:-1])
        if body[:64] in text.replace("\n", "") or body[-64:] in text.replace("\n", ""):
            found.append(key)
    return found


# -- isolation and overload -----------------------------------------------------------------------

ATTACK_EXPECTED = {
    "open_locally": "EACCES",
    "register_without_nonce": "FAILED_PRECONDITION",
    "register_with_unwritten_nonce": "PERMISSION_DENIED",
    "register_with_nonce_in_own_object": "PERMISSION_DENIED",
    "register_with_nonce_for_own_object": "PERMISSION_DENIED",
    "read_through_lookup": "NOT_FOUND",
    "write_through_lookup": "NOT_FOUND",
    "regions_listed": "0",
}


def check_shm_isolation(work: Path) -> tuple[dict, list[str]]:
    """Another process's shm object against an attacker process with another user's rights
    (needs root to start the attacker as), without auth and with a token of its own."""
    if os.geteuid() != 0:
        return {"skipped": "needs root to start the attacker as another user"}, []
    tokens = work / "isolation_tokens"
    tokens.write_text("frontend frontend-secret\nattacker attacker-secret\n")
    results, failures = {}, []
    for label, flags, token in (
        ("no auth", (), None),
        ("token auth", ("--auth-tokens-file", str(tokens)), "attacker-secret"),
    ):
        with victim_object() as name:
            with ServerProcess("--demo-max-rows", "100", "--device", "cpu", *flags) as server:
                command = [sys.executable, "-m", "reliability.shm_attacker", server.target, name]
                if token is not None:
                    command += ["--token", token]
                done = subprocess.run(
                    command, cwd=REPO, capture_output=True, text=True, timeout=120
                )
                ok = done.returncode == 0
                outcome = json.loads(done.stdout) if ok else {"error": done.stderr[-2000:]}
            with open("/dev/shm" + name, "rb") as f:
                outcome["victim_bytes_unchanged"] = f.read(len(SECRET)) == SECRET
        results[label] = outcome
        if outcome != {**ATTACK_EXPECTED, "victim_bytes_unchanged": True}:
            failures.append(f"shm isolation ({label}): {outcome}")
    return results, failures


def _stub(target: str, **options: int) -> tuple[grpc.Channel, lookup_pb2_grpc.EmbeddingLookupStub]:
    channel = grpc.insecure_channel(target, options=list(options.items()))
    return channel, lookup_pb2_grpc.EmbeddingLookupStub(channel)


def check_region_quotas(work: Path) -> tuple[dict, list[str]]:
    """Made-up authorization headers without tokens; identities of a tokens file and the
    server-wide cap."""
    shm_name = f"/ibpembed-quota-{uuid.uuid4().hex[:10]}"
    tokens = work / "quota_tokens"
    tokens.write_text("fe-a token-a\nfe-b token-b\n")
    results: dict = {}
    with SharedMemoryRegion.create(shm_name, 1 << 20) as shm:

        def register(target: str, token: str, count: int, prefix: str) -> int:
            with LookupClient(target, token=token, timeout=30, retry=NO_RETRY) as client:
                for i in range(count):
                    try:
                        client.register_region(f"{prefix}{i}", shm, offset=64 * i, byte_size=64)
                    except LookupServiceError:
                        return i
            return count

        with ServerProcess("--demo-max-rows", "100", "--device", "cpu") as server:
            taken = [register(server.target, f"made-up-{h}", 300, f"h{h}-") for h in range(4)]
        results["no tokens: regions taken under 4 made-up headers"] = taken
        flags = ("--auth-tokens-file", str(tokens), "--max-regions", "300")
        with ServerProcess("--demo-max-rows", "100", "--device", "cpu", *flags) as server:
            a = register(server.target, "token-a", 300, "a")
            b = register(server.target, "token-b", 300, "b")
        results["tokens file, --max-regions 300: regions of fe-a, fe-b"] = [a, b]
    failures = []
    if taken != [256, 0, 0, 0]:
        failures.append(f"made-up headers took {taken} regions (want 256, 0, 0, 0)")
    if [a, b] != [256, 44]:
        failures.append(f"tokens file identities took {[a, b]} (want 256, 44)")
    return results, failures


def check_stalled_streams() -> tuple[dict, list[str]]:
    """Eight LookupStreams whose 1 MB responses nobody reads, then a fresh client."""
    flags = ("--demo-max-rows", "100", "--device", "cpu", "--stream-write-timeout-s", "5")
    results: dict = {}
    with ServerProcess(*flags) as server:
        channel, _ = _stub(server.target, **{"grpc.http2.bdp_probe": 0})
        call = channel.stream_stream(
            "/ibpembed.v1.EmbeddingLookup/LookupStream",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        rows = [[i % 100 for i in range(2048)]]  # 2,048 NONE rows of 512 bytes
        stalled = [
            call(iter([build_request({"cat_0": rows}, "none") for _ in range(12)]))
            for _ in range(8)
        ]
        time.sleep(2)  # the streams fill their windows and stall
        codes: dict[str, int] = {}
        with LookupClient(server.target, timeout=30, retry=NO_RETRY) as fresh:
            for _ in range(20):
                try:
                    fresh.lookup({"cat_0": [[1, 2]]})
                    codes["OK"] = codes.get("OK", 0) + 1
                except LookupServiceError as err:
                    codes[err.code.name] = codes.get(err.code.name, 0) + 1
            streamed = len(list(fresh.lookup_stream([build_request({"cat_0": [[3]]})] * 10)))
        try:
            ended = bool(server.wait_for("stream cancelled", timeout=30))
        except RuntimeError:  # never printed
            ended = False
        results = {
            "fresh client lookups (20)": codes,
            "fresh client stream responses (10)": streamed,
            "stalled streams ended by the write timeout": ended,
        }
        for c in stalled:
            c.cancel()
        channel.close()
    served = codes == {"OK": 20} and streamed == 10 and ended
    failures = [] if served else [f"stalled streams: {results}"]
    return results, failures


def check_request_sizes() -> tuple[dict, list[str]]:
    """RSS across refused 60 MiB requests; a request naming a million features; input_region
    counts past int64."""
    count = (60 << 20) // 8
    large = []
    for name, first_id in (("cat_0", 10**9), ("no-such-feature", 1)):
        request = pb.LookupRequest()
        feature = request.features.add(name=name)
        feature.ids = np.full(count, first_id, dtype="<i8").tobytes()
        feature.lengths = np.array([count], "<i4").tobytes()
        large.append(request.SerializeToString())
    million = feature_names_request(1_000_000)
    results: dict = {}
    with ServerProcess("--demo-max-rows", "300", "--workers", "1", "--device", "cpu") as server:
        channel, _ = _stub(server.target, **{"grpc.max_send_message_length": 128 << 20})
        lookup = channel.unary_unary("/ibpembed.v1.EmbeddingLookup/Lookup")
        before = peak = server.rss()
        for _ in range(8):
            for request in large:
                with contextlib.suppress(grpc.RpcError):
                    lookup(request, timeout=120)
                peak = max(peak, server.rss())
        results["RSS before / peak over 16 refused 60 MiB requests, MiB"] = [
            before >> 20,
            peak >> 20,
        ]
        health = health_pb2_grpc.HealthStub(channel)
        waits: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                waits.append(time.perf_counter() - started)
                time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        started = time.perf_counter()
        try:
            lookup(million, timeout=60)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        refused_s = time.perf_counter() - started
        time.sleep(0.3)
        stop.set()
        prober.join()
        results["a million features: code, seconds, worst health check seconds"] = [
            code,
            round(refused_s, 3),
            round(max(waits), 3),
        ]
        channel.close()
        shm_name = f"/ibpembed-counts-{uuid.uuid4().hex[:10]}"
        with (
            SharedMemoryRegion.create(shm_name, 1 << 16) as shm,
            LookupClient(server.target, timeout=30, retry=NO_RETRY) as client,
        ):
            client.register_region("in", shm)
            channel, stub = _stub(server.target)
            codes = []
            for num_ids in ([2**62, 2**62], [2**62] * 4):
                request = pb.LookupRequest()
                for i in range(len(num_ids)):
                    request.features.add(name=f"cat_{i}")
                request.input_region.name = "in"
                request.input_region.num_ids.extend(num_ids)
                request.input_region.batch_sizes.extend([1] * len(num_ids))
                try:
                    stub.Lookup(request, timeout=30)
                    codes.append("OK")
                except grpc.RpcError as err:
                    codes.append(err.code().name)
            channel.close()
        results["input_region counts summing past int64 / wrapping to 0"] = codes
        oversize = _input_region_over_the_message_limit(server.target)
        results["a 10M-id input_region (80 MB, over --max-message-mb 64): code, seconds"] = oversize
    failures = []
    if peak - before >= 768 << 20:
        failures.append(f"RSS grew {(peak - before) >> 20} MiB over refused requests")
    if code != "INVALID_ARGUMENT":
        failures.append(f"a million features: {code}")
    if codes != ["INVALID_ARGUMENT", "INVALID_ARGUMENT"]:
        failures.append(f"input counts past int64: {codes}")
    if oversize[0] != "RESOURCE_EXHAUSTED":
        failures.append(f"an input_region over the message limit: {oversize}")
    return results, failures


def _input_region_over_the_message_limit(target: str) -> list:
    """A 30-byte request whose ids lie in a registered region: 80 MB of them, more than a
    request may carry, refused before the server reads them. [code, seconds]."""
    num_ids = 10_000_000
    shm_name = f"/ibpembed-big-{uuid.uuid4().hex[:10]}"
    with (
        SharedMemoryRegion.create(shm_name, 8 * num_ids + (1 << 16)) as shm,
        LookupClient(target, timeout=60, retry=NO_RETRY) as client,
    ):
        client.register_region("big", shm)
        channel, stub = _stub(target)
        request = pb.LookupRequest()
        request.features.add(name="cat_0")
        request.input_region.name = "big"
        request.input_region.num_ids.append(num_ids)
        request.input_region.batch_sizes.append(1)
        started = time.perf_counter()
        try:
            stub.Lookup(request, timeout=60)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        seconds = round(time.perf_counter() - started, 3)
        channel.close()
    return [code, seconds]


def check_table_files(work: Path) -> tuple[dict, list[str]]:
    """A served table file truncated in place; a manifest nested 100,000 deep."""
    directory = work / "tables"
    rows = torch.randn(300, 16, generator=torch.Generator().manual_seed(0))
    pack_table_set(directory, TableSet((TableSource("emb", rows, feature_names=("item",)),)))
    path = directory / read_manifest(directory).tables["emb"].file
    flags = ("--tables", str(directory), "--reload-poll-s", "0.2", "--hot-tier", "off")
    results: dict = {}
    with (
        ServerProcess(*flags, "--device", "cpu") as server,
        LookupClient(server.target, timeout=30, retry=NO_RETRY) as client,
    ):
        os.truncate(path, path.stat().st_size // 2)
        time.sleep(1.0)  # five polls
        try:
            client.lookup({"item": [list(range(300))]}, pooling="none")
            truncated = "OK"
        except LookupServiceError as err:
            truncated = err.code.name
        results["lookup of a table truncated in place"] = truncated
        results["server alive after it"] = server.alive()
        staging = directory / f"{uuid.uuid4().hex}.tmp"
        staging.write_text("[" * 100_000 + "]" * 100_000)
        os.replace(staging, directory / MANIFEST)
        time.sleep(2.0)  # ten polls
        rejections = sum("nested too deeply" in line for line in server.stderr_lines)
        results["rejections of a manifest nested 100,000 deep over 10 polls"] = rejections
    racing, alive = _lookups_racing_a_truncation(work / "racing")
    results["lookups racing a truncation, no poll: outcomes"] = racing
    results["server alive after it (no poll)"] = alive
    failures = []
    if truncated != "FAILED_PRECONDITION" or not results["server alive after it"]:
        failures.append(f"truncated table: {truncated}")
    if rejections != 1:
        failures.append(f"deep manifest rejected {rejections} times (want once)")
    # A lookup in flight as the file is cut may read before or after the cut.
    unexpected = set(racing) - {
        "OK before",
        "FAILED_PRECONDITION before",
        "FAILED_PRECONDITION after",
    }
    if unexpected or not racing.get("FAILED_PRECONDITION after") or not alive:
        failures.append(f"lookups racing a truncation (no poll): {racing}, alive {alive}")
    return results, failures


def _lookups_racing_a_truncation(directory: Path) -> tuple[dict[str, int], bool]:
    """Lookups of every row, back to back, while the table file is truncated in place at a page
    boundary, with the poll off (``--reload-poll-s 0``): only the lookups can find it. Outcomes
    by whether the lookup started before or after the truncation: every lookup after it must be
    refused (an OK would be rows read as zeros), and the server must live."""
    rows = torch.randn(20_000, 16, generator=torch.Generator().manual_seed(1))
    pack_table_set(directory, TableSet((TableSource("emb", rows, feature_names=("item",)),)))
    path = directory / read_manifest(directory).tables["emb"].file
    flags = ("--tables", str(directory), "--reload-poll-s", "0", "--hot-tier", "off")
    outcomes: dict[str, int] = {}
    truncated_at = float("inf")
    stop = threading.Event()
    with (
        ServerProcess(*flags, "--device", "cpu") as server,
        LookupClient(server.target, timeout=30, retry=NO_RETRY) as client,
    ):

        def look() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.lookup({"item": [list(range(0, 20_000, 7))]}, pooling="none")
                    code = "OK"
                except LookupServiceError as err:
                    code = err.code.name
                key = f"{code} {'after' if started > truncated_at else 'before'}"
                outcomes[key] = outcomes.get(key, 0) + 1

        thread = threading.Thread(target=look)
        thread.start()
        time.sleep(0.5)
        page = os.sysconf("SC_PAGE_SIZE")
        os.truncate(path, path.stat().st_size // 2 // page * page)
        truncated_at = time.monotonic()
        time.sleep(1.0)
        stop.set()
        thread.join()
        return outcomes, server.alive()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if shutil.which("openssl") is None:
        print("needs the openssl CLI", file=sys.stderr)
        return 2
    report: dict = {"command": "python -m reliability.security"}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ibpembed-security-") as tmp:
        work = Path(tmp)
        pki = make_pki(work / "pki")
        token_file = work / "token"
        token_file.write_text(TOKEN + "\n")
        tls = TlsOptions(root_certificates=(pki / "ca.crt").read_bytes())
        flags = [
            "--tls-cert",
            str(pki / "server.crt"),
            "--tls-key",
            str(pki / "server.key"),
            "--auth-token-file",
            str(token_file),
            "--log-level",
            "debug",
            "--demo-max-rows",
            "100",
            "--device",
            "cpu",
        ]
        with ServerProcess(*flags) as server:
            with grpc.secure_channel(server.target, tls.credentials()) as channel:
                for name, check in (("tokens", check_tokens), ("probes", check_probes)):
                    report[name], found = check(channel)
                    failures += found
            report["reflection"], found = check_reflection_with_token(server.target, tls)
            failures += found
            report["tls"], found = check_tls(server.target, pki, tls)
            failures += found
            load_json = work / "loadgen.json"
            loadgen.main(
                [
                    "--target",
                    server.target,
                    "--requests",
                    "5",
                    "--warmup",
                    "0",
                    "--no-progress",
                    "--token",
                    TOKEN,
                    "--tls-ca",
                    str(pki / "ca.crt"),
                    "--json",
                    str(load_json),
                ]
            )
            server.stop()
            server_log = server.log()
        report["mtls"], found = check_mtls(pki, token_file)
        failures += found
        mtls_log = report["mtls"].pop("log")
        report["empty_token_file"], found = check_empty_token_file(work)
        failures += found
        leaks = {
            "server log": secrets_in(server_log + mtls_log, pki),
            "loadgen report": secrets_in(load_json.read_text(), pki),
        }
        report["secrets_found"] = leaks
        report["server_log_lines"] = len(server_log.splitlines())
        failures += [f"{where} holds {what}" for where, what in leaks.items() if what]
        for name, check in (
            ("shm_isolation", lambda: check_shm_isolation(work)),
            ("region_quotas", lambda: check_region_quotas(work)),
            ("stalled_streams", check_stalled_streams),
            ("request_sizes", check_request_sizes),
            ("table_files", lambda: check_table_files(work)),
        ):
            report[name], found = check()
            failures += found
    report["failures"] = failures
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
