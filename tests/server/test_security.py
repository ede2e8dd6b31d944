# SPDX-License-Identifier: Apache-2.0
"""TLS, mTLS and bearer tokens: the right credentials are accepted, wrong ones rejected."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, TlsOptions, loadgen
from tests.engine.helpers import RecordingObserver, make_store
from tests.server.helpers import RunningServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
NO_RETRY = RetryPolicy(max_attempts=1)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(cwd: Path, name: str, ca: str, subject: str, ext: str) -> None:
    """A key and a certificate for ``name`` signed by ``ca``."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject,
             "-out", f"{name}.csr", cwd=cwd)  # fmt: skip
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
             cwd=cwd)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """Two CAs (trusted, rogue), a server cert for 127.0.0.1, client certs from each CA."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key",
                 "-subj", f"/CN={ca}", "-days", "2", "-out", f"{ca}.crt", cwd=d)  # fmt: skip
    _issue(d, "server", "ca", "/CN=ibpembed-test",
           "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    _issue(d, "client", "ca", "/CN=frontend", "extendedKeyUsage=clientAuth\n")
    _issue(d, "rogue_client", "rogue", "/CN=intruder", "extendedKeyUsage=clientAuth\n")
    return d


def _tls(pki: Path, client: str | None = None) -> TlsOptions:
    read = lambda name: (pki / name).read_bytes()  # noqa: E731
    if client is None:
        return TlsOptions(root_certificates=read("ca.crt"))
    return TlsOptions(read("ca.crt"), read(f"{client}.key"), read(f"{client}.crt"))


def _code(client: LookupClient) -> grpc.StatusCode | None:
    try:
        client.lookup({"user": [[1]]})
    except LookupServiceError as err:
        return err.code
    finally:
        client.close()
    return None


def test_tls(pki):
    settings = {"tls_cert": str(pki / "server.crt"), "tls_key": str(pki / "server.key")}
    with RunningServer(make_store(), **settings) as running:
        assert _code(LookupClient(running.target, tls=_tls(pki), timeout=30)) is None
        # Plaintext to a TLS port, and a client that does not trust the server's CA, both fail.
        assert _code(LookupClient(running.target, timeout=5, retry=NO_RETRY)) is not None
        rogue = TlsOptions(root_certificates=(pki / "rogue.crt").read_bytes())
        assert _code(LookupClient(running.target, tls=rogue, timeout=5, retry=NO_RETRY)) == (
            grpc.StatusCode.UNAVAILABLE
        )


def test_mtls_requires_a_client_certificate_from_the_ca(pki):
    settings = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "tls_client_ca": str(pki / "ca.crt"),
    }
    with RunningServer(make_store(), **settings) as running:
        ok = LookupClient(running.target, tls=_tls(pki, "client"), timeout=30)
        assert _code(ok) is None
        mtls_flags = ["--tls-ca", str(pki / "ca.crt"), "--tls-cert", str(pki / "client.crt"),
                      "--tls-key", str(pki / "client.key")]  # fmt: skip
        argv = ["--target", running.target, "--requests", "3", "--warmup", "0", "--no-progress"]
        assert loadgen.main([*argv, *mtls_flags]) == 0
        for tls in (_tls(pki), _tls(pki, "rogue_client")):
            client = LookupClient(running.target, tls=tls, timeout=5, retry=NO_RETRY)
            assert _code(client) == grpc.StatusCode.UNAVAILABLE


def test_bearer_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    recorder = RecordingObserver()
    with RunningServer(make_store(), observer=recorder, auth_token_file=str(token_file)) as running:
        assert _code(LookupClient(running.target, token="s3cret-token", timeout=30)) is None
        for token in (None, "wrong", "s3cret-token-but-longer"):
            client = LookupClient(running.target, token=token, timeout=30)
            assert _code(client) == grpc.StatusCode.UNAUTHENTICATED
        # Streams and table listing are protected too; health stays open for probes.
        anonymous = LookupClient(running.target, timeout=30)
        with pytest.raises(LookupServiceError) as info:
            anonymous.list_tables()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(LookupServiceError) as info:
            list(anonymous.lookup_stream([]))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.is_serving()
        anonymous.close()
    # Rejections count in requests by code like every other outcome (health is not counted).
    assert recorder.rpcs.count(("Lookup", "UNAUTHENTICATED")) == 3
    assert ("ListTables", "UNAUTHENTICATED") in recorder.rpcs
    assert ("LookupStream", "UNAUTHENTICATED") in recorder.rpcs
