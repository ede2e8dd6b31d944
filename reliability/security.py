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
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, TlsOptions, loadgen
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from reliability.common import make_pki
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
    report["failures"] = failures
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
