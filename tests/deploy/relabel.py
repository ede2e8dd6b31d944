# SPDX-License-Identifier: Apache-2.0
"""The labels a scraped ibpembed target ends up with, on each discovery path, computed offline.

Prometheus turns a discovered target's meta labels into its series' labels with
``relabel_configs``. Two configurations reach production: ``deploy/prometheus/prometheus.yml``
(DNS SRV discovery, written by hand) and the one the Prometheus operator generates from
``deploy/k8s/monitoring/podmonitor.yaml``. No cluster runs here, so this module applies both
with Prometheus's relabelling rules; the operator's part follows ``generatePodMonitorConfig``
in prometheus-operator's ``pkg/prometheus/promcfg.go`` for the fields a PodMonitor of ours uses
(selector matchLabels, port, podTargetLabels, jobLabel, relabelings). Its hashmod sharding
rules are left out: they only write ``__tmp`` labels, which never reach a series.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

Labels = dict[str, str]
Rule = Mapping[str, Any]

_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_GROUP_REF = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def sanitize(name: str) -> str:
    """A Kubernetes label key as a Prometheus label name (the operator's sanitizeLabelName)."""
    return _INVALID_LABEL_CHARS.sub("_", name)


def _expand(template: str, match: re.Match[str]) -> str:
    """Go's ``Regexp.Expand``: ``$1``/``${1}``/``${name}``; an unknown group expands to ""."""

    def group(m: re.Match[str]) -> str:
        ref = m.group(1) or m.group(2)
        try:
            return match.group(int(ref) if ref.isdigit() else ref) or ""
        except IndexError:
            return ""

    return _GROUP_REF.sub(group, template)


def relabel(labels: Labels, rules: Iterable[Rule]) -> Labels | None:
    """Prometheus's ``relabel.Process``: the labels after ``rules``, or None if dropped.

    Only the actions our configurations use (replace, keep, drop); regexes are anchored, source
    values joined with ``;``, and a replace that yields an empty value deletes the label.
    """
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        value = rule.get("separator", ";").join(
            labels.get(name, "") for name in rule.get("source_labels", [])
        )
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep":
            if match is None:
                return None
        elif action == "drop":
            if match is not None:
                return None
        elif action == "replace":
            if match is None:
                continue
            target = _expand(rule["target_label"], match)
            result = _expand(rule.get("replacement", "$1"), match)
            if result:
                labels[target] = result
            else:
                labels.pop(target, None)
        else:
            raise ValueError(f"relabel action {action!r} is not modelled here")
    return labels


def series_labels(discovered: Labels, rules: Iterable[Rule]) -> Labels | None:
    """What a target's series carry: relabelled, ``__`` labels gone, instance from the address."""
    labels = relabel(discovered, rules)
    if labels is None:
        return None
    labels.setdefault("instance", labels["__address__"])
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def _from_spec(relabelings: Iterable[Mapping[str, Any]]) -> list[Rule]:
    """A PodMonitor's camelCase relabelings as Prometheus relabel_configs."""
    names = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "regex": "regex",
        "replacement": "replacement",
        "separator": "separator",
        "action": "action",
    }
    return [{names[k]: v for k, v in r.items()} for r in relabelings]


def pod_monitor_rules(monitor: Mapping[str, Any], endpoint: int = 0) -> list[Rule]:
    """The relabel_configs the operator writes for one podMetricsEndpoint of ``monitor``."""
    meta, spec = monitor["metadata"], monitor["spec"]
    ep = spec["podMetricsEndpoints"][endpoint]
    rules: list[Rule] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {
            "action": "drop",
            "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": "(Failed|Succeeded)",
        },
    ]
    for key, value in sorted(spec["selector"].get("matchLabels", {}).items()):
        rules.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_pod_label_{sanitize(key)}",
                    f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}",
                ],
                "regex": f"({value});true",
            }
        )
    if ep.get("port"):
        rules.append(
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": ep["port"],
            }
        )
    rules += [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    for key in spec.get("podTargetLabels", []):
        rules.append(
            {
                "source_labels": [f"__meta_kubernetes_pod_label_{sanitize(key)}"],
                "target_label": sanitize(key),
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    rules.append({"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"})
    if spec.get("jobLabel"):
        rules.append(
            {
                "source_labels": [f"__meta_kubernetes_pod_label_{sanitize(spec['jobLabel'])}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    if ep.get("port"):
        rules.append({"target_label": "endpoint", "replacement": ep["port"]})
    return rules + _from_spec(ep.get("relabelings", []))


def pod_target(
    monitor: Mapping[str, Any],
    pod_labels: Mapping[str, str],
    *,
    pod_name: str,
    pod_ip: str,
    container: str,
    port_name: str,
    port: int,
) -> Labels:
    """The meta labels Kubernetes pod discovery gives one container port of a Running pod."""
    meta = monitor["metadata"]
    labels: Labels = {
        "job": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "__address__": f"{pod_ip}:{port}",
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": pod_name,
        "__meta_kubernetes_pod_ip": pod_ip,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_container_port_name": port_name,
        "__meta_kubernetes_pod_container_port_number": str(port),
    }
    for key, value in pod_labels.items():
        labels[f"__meta_kubernetes_pod_label_{sanitize(key)}"] = value
        labels[f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"] = "true"
    return labels


def dns_srv_target(job_name: str, name: str, target: str, port: int) -> Labels:
    """The meta labels DNS SRV discovery gives one record of ``name`` (a replica)."""
    return {
        "job": job_name,
        "__address__": f"{target.rstrip('.')}:{port}",
        "__meta_dns_name": name,
        "__meta_dns_srv_record_target": target,
        "__meta_dns_srv_record_port": str(port),
    }
