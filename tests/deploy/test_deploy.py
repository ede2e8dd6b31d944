# SPDX-License-Identifier: Apache-2.0
"""deploy/ and the Dockerfile, checked offline: promtool, hadolint, Kubernetes schemas, and the
consistency of ports, shard counts, names and metric names across the files.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ibpembed.cli import build_parser
from ibpembed.server import config as server_config
from ibpembed.server.app import SERVICE_NAME
from ibpembed.server.metrics import ServerMetrics
from ibpembed_client import LookupClient, ShardMap
from tests.metrics.helpers import PROMTOOL, free_port, needs_promtool
from tests.server.helpers import RunningServer, make_store

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "ibpembed.json"
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)
# Oldest Kubernetes the manifests target (the pod-index label) and the newest bundled schema.
K8S_VERSIONS = ("1.28.0", "1.37.0")
# Values for the dashboard's template variables when its queries are checked.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$job": "ibpembed",
    "$instance": ".*",
    "$table": ".*",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS
    )


def manifests() -> dict[str, dict]:
    """Every Kubernetes object in deploy/k8s, by kind."""
    objects = [
        doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
    ]
    by_kind = {obj["kind"]: obj for obj in objects}
    assert len(by_kind) == len(objects), "one object per kind expected"
    return by_kind


def container(objects: dict[str, dict]) -> dict:
    (only,) = objects["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


# -- Prometheus -------------------------------------------------------------------------------


@needs_promtool
def test_prometheus_config_and_rules_check():
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "alerts_test.yml"),
    ):
        result = promtool(*args)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_alerts_cover_latency_errors_and_target_down():
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {
        "IbpembedLookupLatencyOverBudget",
        "IbpembedErrorRateHigh",
        "IbpembedTargetDown",
    } <= set(alerts)
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_scrape_config_discovers_the_headless_service_metrics_port():
    objects = manifests()
    service = objects["Service"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    name = f"_metrics._tcp.{service['metadata']['name']}.{service['metadata']['namespace']}"
    assert sd["names"] == [f"{name}.svc.cluster.local"]
    assert "metrics" in ports
    assert job["job_name"] == "ibpembed"


# -- Grafana ----------------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Sample names the server exports, and the recording rules' names."""
    names = set()
    for family in ServerMetrics(make_store(), device="cpu").registry.collect():
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_count", "_sum"),
            "info": ("_info",),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    names |= {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with the template variables filled in)."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((panel["title"], expr))
    return queries


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"]
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for subject in (
        "latency quantiles",
        "requests per second",
        "errors per second by code",
        "bytes saved per table",
        "compression ratio per table",
        "decoded bytes per second",
    ):
        assert subject in titles
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance", "table"} <= variables


def test_dashboard_queries_use_exported_metrics():
    exported = exported_names()
    for title, expr in dashboard_queries():
        used = set(re.findall(r"\bibpembed[a-z_:]*[a-z]\b", expr))
        assert used, f"{title}: no ibpembed metric in {expr}"
        assert used <= exported, f"{title}: unknown {used - exported}"
        assert "$" not in expr, f"{title}: unfilled variable in {expr}"


@needs_promtool
def test_dashboard_queries_parse(tmp_path):
    """Each query, as a recording rule, through promtool's PromQL parser."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for kind, obj in manifests().items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind} against Kubernetes {version}: {exc.message}")


def test_validator_rejects_a_misspelled_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    broken = copy.deepcopy(manifests()["StatefulSet"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_statefulset_ordinal_picks_the_shard(tmp_path):
    objects = manifests()
    sts = objects["StatefulSet"]
    service = objects["Service"]
    c = container(objects)
    env = env_of(c)
    replicas = sts["spec"]["replicas"]
    assert env["SHARDS"]["value"] == str(replicas)
    field = env["SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()

    # The shard map in the ConfigMap: one shard per pod, each at its pod's stable DNS name and
    # in the directory the pod's --tables flag names.
    shard_map_text = objects["ConfigMap"]["data"]["shard_map.json"]
    shard_map = json.loads(shard_map_text)
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    namespace = sts["metadata"]["namespace"]
    for k, shard in enumerate(shard_map["shards"]):
        pod = f"{sts['metadata']['name']}-{k}"
        host = f"{pod}.{service['metadata']['name']}.{namespace}.svc.cluster.local"
        assert shard["address"] == f"{host}:{grpc_port}"
        args = [a.replace("$(SHARD_INDEX)", str(k)) for a in c["args"]]
        args = [a.replace("$(SHARDS)", str(replicas)) for a in args]
        parsed = build_parser().parse_args(args)
        assert parsed.command == "serve"
        assert Path(parsed.tables) == Path("/tables") / shard["directory"]
    assert len(shard_map["shards"]) == replicas
    path = tmp_path / "shard_map.json"
    path.write_text(shard_map_text)
    assert ShardMap.load(path)


def test_server_settings_and_ports_agree(tmp_path):
    objects = manifests()
    c = container(objects)
    settings = tmp_path / "server.toml"
    settings.write_text(objects["ConfigMap"]["data"]["server.toml"])
    config = server_config.load(environ={"IBPEMBED_CONFIG": str(settings)})
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    assert config.host == "0.0.0.0"
    # Drain (grace_s) finishes before the kubelet's SIGKILL.
    grace = objects["StatefulSet"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert config.grace_s < grace
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == config.port
    assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert env_of(c)["IBPEMBED_CONFIG"]["value"] == f"/etc/ibpembed/{settings.name}"
    service_ports = {p["name"]: p["port"] for p in objects["Service"]["spec"]["ports"]}
    assert service_ports == ports


def test_pods_request_a_gpu_and_run_unprivileged():
    objects = manifests()
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod_security = objects["StatefulSet"]["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


# -- Dockerfile -------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (requirements/deploy.txt)")
def test_hadolint_clean():
    result = subprocess.run(
        [HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_dockerfile_builds_like_ci_and_serves_unprivileged():
    instructions = dockerfile_instructions()
    stages = [args for op, args in instructions if op == "FROM"]
    assert len(stages) == 2
    assert "cuda" in stages[0] and stages[0].endswith("AS build")
    assert "cuda" in stages[1] and "-runtime-" in stages[1]
    runs = [args for op, args in instructions if op == "RUN"]
    # The image installs and builds with the set-up CI's `make test` runs first (make setup).
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.MULTILINE)
    assert any(re.match(r"make setup\b", run) for run in runs)
    (user,) = [args for op, args in instructions if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    (exposed,) = [args.split() for op, args in instructions if op == "EXPOSE"]
    defaults = server_config.ServerConfig()
    assert sorted(map(int, exposed)) == sorted((defaults.port, defaults.metrics_port))
    env = " ".join(args for op, args in instructions if op == "ENV")
    assert "IBPEMBED_HOST=0.0.0.0" in env


def healthcheck_command() -> list[str]:
    (args,) = [args for op, args in dockerfile_instructions() if op == "HEALTHCHECK"]
    return json.loads(args.split("CMD", 1)[1])


def test_healthcheck_asks_the_grpc_health_service():
    """The image's HEALTHCHECK command, run here: 0 against a serving server, 1 without one."""
    command = healthcheck_command()
    assert command[0] == "python" and SERVICE_NAME in command[-1]
    command[0] = sys.executable
    with RunningServer(make_store()) as running:
        port = running.target.rsplit(":", 1)[1]
        ok = subprocess.run(
            command, env={**os.environ, "IBPEMBED_PORT": port}, capture_output=True, timeout=60
        )
        assert ok.returncode == 0, ok.stderr
        # Draining: health turns NOT_SERVING before the port closes.
        running.run(running.server.health.enter_graceful_shutdown())
        assert not LookupClient(running.target).is_serving(SERVICE_NAME)
        draining = subprocess.run(
            command, env={**os.environ, "IBPEMBED_PORT": port}, capture_output=True, timeout=60
        )
        assert draining.returncode == 1, draining.stderr
    down = subprocess.run(
        command,
        env={**os.environ, "IBPEMBED_PORT": str(free_port())},
        capture_output=True,
        timeout=60,
    )
    assert down.returncode == 1, down.stderr


def test_dockerignore_keeps_local_builds_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "**/*.so"):
        assert entry in ignored
