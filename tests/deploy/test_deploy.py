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
from ibpembed.engine.tier import HotTier
from ibpembed.server import config as server_config
from ibpembed.server.app import SERVICE_NAME
from ibpembed.server.metrics import ServerMetrics
from ibpembed_client import LookupClient, ShardMap
from tests.deploy.dockerfile import DOCKERFILE, stages
from tests.deploy.kustomize import K8S, by_kind, container, env_of, render, shard_deployments
from tests.engine.helpers import make_store
from tests.metrics.helpers import PROMTOOL, free_port, needs_promtool
from tests.server.helpers import RunningServer

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "ibpembed.json"
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


def test_scrape_config_discovers_every_shards_metrics_service():
    objects = render()
    services = by_kind(objects, "Service")
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    expected = []
    for k, _ in enumerate(shard_deployments(objects)):
        service = services[f"ibpembed-shard-metrics-{k}"]
        assert service["spec"]["publishNotReadyAddresses"] is True  # NotReady shards alert
        assert {p["name"] for p in service["spec"]["ports"]} == {"metrics"}
        namespace = service["metadata"]["namespace"]
        name = f"_metrics._tcp.{service['metadata']['name']}.{namespace}.svc.cluster.local"
        expected.append(name)
        (shard_rule,) = [r for r in job["relabel_configs"] if r["target_label"] == "shard"]
        assert re.fullmatch(shard_rule["regex"], name).group(1) == str(k)
    assert sd["names"] == expected
    assert job["job_name"] == "ibpembed"


# -- Grafana ----------------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Sample names the server exports, and the recording rules' names."""
    names = set()
    store = make_store()
    metrics = ServerMetrics(store, device="cpu")
    metrics.watch_hot_tier(HotTier(store, budget="1%"))
    for family in metrics.registry.collect():
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


def test_dashboard_legends_name_labels_as_grafana_expands_them():
    # Grafana expands {{label}}; a doubled brace (an escaped format string) shows literally.
    legends = [
        target["legendFormat"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
        if target.get("legendFormat")
    ]
    assert legends
    for legend in legends:
        assert "{{{" not in legend and "}}}" not in legend, legend
        assert legend.count("{{") == legend.count("}}"), legend


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


def test_kustomization_puts_the_namespace_first_and_everything_in_it():
    objects = render()
    assert objects[0]["kind"] == "Namespace"  # a fresh cluster takes the rest after it
    namespace = objects[0]["metadata"]["name"]
    for obj in objects[1:]:
        assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    kinds = {o["kind"] for o in objects}
    assert kinds == {
        "Namespace",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }


@pytest.mark.parametrize("overlay", ["", "gpu"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate(version, overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in render(K8S / overlay):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} on {version}: {exc.message}")


def test_validator_rejects_a_misspelled_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    broken = copy.deepcopy(shard_deployments(render())[0])
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_each_shard_has_replicas_behind_its_own_headless_service(tmp_path):
    objects = render()
    deployments = shard_deployments(objects)
    services = by_kind(objects, "Service")
    budgets = by_kind(objects, "PodDisruptionBudget")
    autoscalers = by_kind(objects, "HorizontalPodAutoscaler")
    shards = len(deployments)
    assert shards >= 2
    (config_map,) = by_kind(objects, "ConfigMap").values()
    shard_map_text = config_map["data"]["shard_map.json"]
    shard_map = json.loads(shard_map_text)
    assert len(shard_map["shards"]) == shards
    for k, deployment in enumerate(deployments):
        name = deployment["metadata"]["name"]
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        assert pods["ibpembed.dev/shard"] == str(k)
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pods.items()
        assert deployment["spec"]["replicas"] >= 2  # one may be away, the shard still serves
        c = container(deployment)
        env = env_of(c)
        assert (env["SHARD_INDEX"]["value"], env["SHARDS"]["value"]) == (str(k), str(shards))
        args = [
            a.replace("$(SHARD_INDEX)", str(k)).replace("$(SHARDS)", str(shards)) for a in c["args"]
        ]
        parsed = build_parser().parse_args(args)
        assert parsed.command == "serve"
        assert Path(parsed.tables) == Path("/tables") / shard_map["shards"][k]["directory"]
        # Its own headless Service, selecting its replicas and no other shard's.
        service = services[name]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert not service["spec"].get("publishNotReadyAddresses")  # clients get Ready ones
        grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        namespace = service["metadata"]["namespace"]
        address = f"dns:///{name}.{namespace}.svc.cluster.local:{grpc_port}"
        assert shard_map["shards"][k]["address"] == address
        metrics = services[f"ibpembed-shard-metrics-{k}"]
        assert metrics["spec"]["selector"] == service["spec"]["selector"]
        # One replica of the shard at a time may be disrupted; the HPA scales this shard.
        assert budgets[name]["spec"]["maxUnavailable"] == 1
        assert budgets[name]["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        target = autoscalers[name]["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert autoscalers[name]["spec"]["minReplicas"] >= 2
        # Replicas of one shard spread over nodes (a node loss takes one of them).
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        by_key = {s["topologyKey"]: s for s in spread}
        assert by_key["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
        assert all(s["matchLabelKeys"] == ["ibpembed.dev/shard"] for s in spread)
    path = tmp_path / "shard_map.json"
    path.write_text(shard_map_text)
    assert ShardMap.load(path).addresses[0].startswith("dns:///")


def test_the_monitoring_overlay_adds_a_pod_monitor_of_every_replica():
    base = render()
    objects = render(K8S / "monitoring")
    (monitor,) = by_kind(objects, "PodMonitor").values()
    assert len(objects) == len(base) + 1
    labels = shard_deployments(base)[0]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    # The labels it gives the series: tests/deploy/test_alert_labels.py.
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"


def test_server_settings_ports_and_probes_agree(tmp_path):
    objects = render()
    (config_map,) = by_kind(objects, "ConfigMap").values()
    settings = tmp_path / "server.toml"
    settings.write_text(config_map["data"]["server.toml"])
    config = server_config.load(environ={"IBPEMBED_CONFIG": str(settings)})
    assert config.host == "0.0.0.0" and config.device == "auto" and config.keep_versions >= 2
    for deployment in shard_deployments(objects):
        c = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": config.port, "metrics": config.metrics_port}
        # Drain (grace_s) finishes before the kubelet's SIGKILL.
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert config.grace_s < grace
        # Ready = serving; live = the process answers, also while it loads (NOT_SERVING then).
        assert c["readinessProbe"]["grpc"] == {"port": config.port, "service": SERVICE_NAME}
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert env_of(c)["IBPEMBED_CONFIG"]["value"] == f"/etc/ibpembed/{settings.name}"


def test_pods_run_unprivileged():
    for deployment in shard_deployments(render()):
        c = container(deployment)
        pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] != 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True


def _gpus(deployment: dict) -> tuple[str | None, str | None, list[dict]]:
    resources = container(deployment)["resources"]
    return (
        resources.get("requests", {}).get("nvidia.com/gpu"),
        resources.get("limits", {}).get("nvidia.com/gpu"),
        deployment["spec"]["template"]["spec"].get("tolerations", []),
    )


def test_the_default_manifests_run_on_cpus_and_request_no_gpu():
    for overlay in (K8S, K8S / "monitoring"):
        objects = render(overlay)
        assert "nvidia.com/gpu" not in yaml.safe_dump_all(objects), overlay
        for deployment in shard_deployments(objects):
            assert _gpus(deployment) == (None, None, [])


def test_the_gpu_overlay_adds_one_gpu_per_replica_and_changes_nothing_else():
    default, gpu = render(), render(K8S / "gpu")
    assert [(o["kind"], o["metadata"]["name"]) for o in gpu] == [
        (o["kind"], o["metadata"]["name"]) for o in default
    ]
    for cpu_deployment, gpu_deployment in zip(
        shard_deployments(default), shard_deployments(gpu), strict=True
    ):
        requests, limits, tolerations = _gpus(gpu_deployment)
        assert requests == limits == "1"
        assert tolerations == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        stripped = copy.deepcopy(gpu_deployment)
        resources = container(stripped)["resources"]
        del resources["requests"]["nvidia.com/gpu"], resources["limits"]["nvidia.com/gpu"]
        del stripped["spec"]["template"]["spec"]["tolerations"]
        assert stripped == cpu_deployment


# -- Dockerfile -------------------------------------------------------------------------------


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (requirements/deploy.txt)")
def test_hadolint_clean():
    result = subprocess.run(
        [HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_dockerfile_installs_the_runtime_requirements_first_and_serves_unprivileged():
    by_name = stages()
    assert list(by_name)[-1] == "server"  # the default target
    build, runtime = by_name["build"], by_name["server"]
    assert "cuda" in build[0][1] and build[0][1].endswith("AS build")
    assert "cuda" in runtime[0][1] and "-runtime-" in runtime[0][1]

    def first(stage: list[tuple[str, str]], op: str, text: str) -> int:
        return next(i for i, (o, args) in enumerate(stage) if o == op and text in args)

    # The dependency layers come before any source, so a source edit keeps them cached.
    for stage in (build, runtime):
        requirements = first(stage, "COPY", "requirements/runtime.txt")
        install = first(stage, "RUN", "pip install -r")
        sources = [
            i for i, (op, args) in enumerate(stage) if op == "COPY" and "requirements" not in args
        ]
        assert requirements < install < min(sources)
    # The runtime stage: the runtime pins and the built wheels only, nothing editable.
    runs = " ".join(args for op, args in runtime if op == "RUN")
    assert "-r /tmp/runtime.txt" in runs and "dev.txt" not in runs and " -e " not in runs
    assert "--no-deps /tmp/wheels/*.whl" in runs
    copies = [args for op, args in runtime if op == "COPY"]
    assert copies == [
        "requirements/runtime.txt /tmp/runtime.txt",
        "--from=build /wheels /tmp/wheels",
    ]
    text = DOCKERFILE.read_text()
    assert "driver >= 580" in text  # the CUDA 13 base's requirement, documented
    (user,) = [args for op, args in runtime if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    (exposed,) = [args.split() for op, args in runtime if op == "EXPOSE"]
    defaults = server_config.ServerConfig()
    assert sorted(map(int, exposed)) == sorted((defaults.port, defaults.metrics_port))
    env = " ".join(args for op, args in runtime if op == "ENV")
    assert "IBPEMBED_HOST=0.0.0.0" in env


def healthcheck_command() -> list[str]:
    (args,) = [args for op, args in stages()["server"] if op == "HEALTHCHECK"]
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
