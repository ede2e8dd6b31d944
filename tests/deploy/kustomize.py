# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s as ``kubectl kustomize`` renders it, and the objects the tests look at."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")


def render(directory: Path = K8S) -> list[dict]:
    """``kubectl kustomize DIR``: every object ``kubectl apply -k DIR`` would send, in order."""
    if KUBECTL is None:
        pytest.skip("kubectl (with kustomize) not installed")
    result = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def shard_deployments(objects: list[dict]) -> list[dict]:
    """The shards' Deployments, in shard order (ibpembed-shard-<k>)."""
    deployments = by_kind(objects, "Deployment")
    return [deployments[f"ibpembed-shard-{k}"] for k in range(len(deployments))]
