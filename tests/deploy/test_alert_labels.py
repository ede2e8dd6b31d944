# SPDX-License-Identifier: Apache-2.0
"""The alerts fire on both discovery paths: the label contract of deploy/prometheus/alerts.yml
(``job="ibpembed"``, ``shard``, ``pod``, ``instance``) holds for the series that the static
config (prometheus.yml) and the Prometheus operator (the PodMonitor) produce.

Each path's labels are computed from its own configuration (tests/deploy/relabel.py), then fed
to ``promtool test rules``: one replica of shard 1 stops answering scrapes, and TargetDown must
fire for it, naming its shard, while Absent stays silent.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import relabel
from tests.deploy.kustomize import K8S, by_kind, container, render, shard_deployments
from tests.metrics.helpers import PROMTOOL, needs_promtool

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
SHARD = 1  # the shard whose replica goes down
DOWN = "IbpembedTargetDown"


def _operator_series() -> list[relabel.Labels]:
    """The series labels of one replica per shard, as the operator's PodMonitor config gives."""
    objects = render(K8S / "monitoring")
    (monitor,) = by_kind(objects, "PodMonitor").values()
    series = []
    for k, deployment in enumerate(shard_deployments(objects)):
        c = container(deployment)
        (port,) = [p for p in c["ports"] if p["name"] == "metrics"]
        discovered = relabel.pod_target(
            monitor,
            deployment["spec"]["template"]["metadata"]["labels"],
            pod_name=f"{deployment['metadata']['name']}-5d8f7b9c4-x{k}q2z",
            pod_ip=f"10.0.{k}.7",
            container=c["name"],
            port_name=port["name"],
            port=port["containerPort"],
        )
        labels = relabel.series_labels(discovered, relabel.pod_monitor_rules(monitor))
        assert labels is not None, f"the PodMonitor drops shard {k}'s replica"
        series.append(labels)
    return series


def _static_series() -> list[relabel.Labels]:
    """The same replicas as prometheus.yml's DNS SRV discovery labels them."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ibpembed"]
    (sd,) = job["dns_sd_configs"]
    series = []
    for k, name in enumerate(sd["names"]):
        service = name.split(".")[2]  # _metrics._tcp.<service>.<namespace>...
        target = f"10-0-{k}-7.{service}.ibpembed.svc.cluster.local."
        discovered = relabel.dns_srv_target(job["job_name"], name, target, 9464)
        labels = relabel.series_labels(discovered, job["relabel_configs"])
        assert labels is not None
        series.append(labels)
    return series


PATHS = {"static config": _static_series, "Prometheus operator": _operator_series}


def _selector(labels: relabel.Labels) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@pytest.mark.parametrize("path", PATHS)
def test_each_path_labels_the_job_shard_and_pod_as_the_rules_expect(path: str) -> None:
    series = PATHS[path]()
    assert len(series) >= 2
    for k, labels in enumerate(series):
        assert labels["job"] == "ibpembed", labels
        assert labels["shard"] == str(k), labels
        assert labels["pod"] and labels["instance"], labels


@needs_promtool
@pytest.mark.parametrize("path", PATHS)
def test_target_down_fires_naming_the_shard_and_absent_stays_silent(
    path: str, tmp_path: Path
) -> None:
    series = PATHS[path]()
    down = series[SHARD]
    inputs = [
        {"series": f"up{_selector(labels)}", "values": "1 1 0x18" if k == SHARD else "1x20"}
        for k, labels in enumerate(series)
    ]
    # Every label of the down target's series, the shard included, reaches the alert.
    expected = {
        "exp_labels": {**down, "severity": "critical"},
        "exp_annotations": {
            "summary": f"ibpembed {down['pod']} (shard {SHARD}) is not scraped",
            "description": f"Prometheus cannot scrape {down['instance']}. With row-sharded "
            "tables a missing shard fails every lookup that touches its rows.\n",
        },
    }
    test = {
        "rule_files": [str(PROMETHEUS / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": "3m", "alertname": DOWN, "exp_alerts": []},
                    {"eval_time": "5m", "alertname": DOWN, "exp_alerts": [expected]},
                    {"eval_time": "10m", "alertname": "IbpembedAbsent", "exp_alerts": []},
                ],
            }
        ],
    }
    path_file = tmp_path / "alerts_labels_test.yml"
    path_file.write_text(yaml.safe_dump(test, sort_keys=False))
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(path_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"{path}:\n{result.stdout}{result.stderr}"
