#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs Debian's Prometheus server and promtool (package `prometheus`, 2.42 on Debian 12) for
# the metrics and deploy tests. Needs root; does nothing when both binaries are already there.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "ci_install_prometheus.sh: needs root (apt-get install prometheus)" >&2
    exit 1
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus
prometheus --version 2>&1 | head -n 1
