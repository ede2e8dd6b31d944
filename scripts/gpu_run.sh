#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The device command of a GPU machine: builds ibpembed._C on that machine's own torch (not the
# project's pins; IBPEMBED_CUDA_ARCHS=90 by default, the H200's), runs benchmarks.gpu_check under
# a deadline that ends this whole call inside 9 minutes, and leaves at most 8 files in the output
# folder (the first argument, else $OUT, else benchmarks/.cache/gpu_run):
#
#   gpu_check.json            the merged report: `python -m benchmarks` renders it into
#                             BENCHMARKS.md's GPU section (copy it to benchmarks/results/)
#   gpu_check_phases.tar.gz   every phase's own JSON
#   gpu_check.log             everything printed, the build's errors and the sanitizer's included
#   BENCHMARKS_gpu.md         BENCHMARKS.md rendered from this run alone (its GPU section filled)
#
# Usage: scripts/gpu_run.sh [OUT_DIR] [gpu_check options, e.g. --skip-build --only timing]
# The real table is packed from a wheel the GPU machine cannot install: run
# `python -m benchmarks.gpu_check.real_table` beforehand and carry benchmarks/.cache/real_table.
# GPU_RUN_BUDGET_S (default 530) is the whole call's budget; gpu_check stops starting phases 40 s
# before it and `timeout` ends it 15 s before, which leaves time to render and list the files.
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/.cache/gpu_run}"
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi
budget="${GPU_RUN_BUDGET_S:-530}"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export IBPEMBED_CUDA_ARCHS="${IBPEMBED_CUDA_ARCHS:-90}"
mkdir -p "$out"

"$python" - <<'PY' 2>&1 | tee "$out/gpu_check.log"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available: "
      f"{torch.cuda.is_available()}")
PY
# 4 GiB tables per row size (far past the GPU's L2 and TLB reach) leave the sanitizer room;
# a --table-gib among the arguments overrides it.
timeout -k 10 "$((budget - 15))" "$python" -m benchmarks.gpu_check --table-gib 4 \
    --deadline-s "$((budget - 40))" --out "$out/gpu_check.json" "$@" 2>&1 |
    tee -a "$out/gpu_check.log"
rc=${PIPESTATUS[0]}

if [[ -f "$out/gpu_check.json" ]]; then
    results="$(mktemp -d)"
    cp "$out/gpu_check.json" "$results/"
    "$python" -m benchmarks --render-only --out "$results" --report "$out/BENCHMARKS_gpu.md" \
        >> "$out/gpu_check.log" 2>&1 ||
        echo "rendering BENCHMARKS_gpu.md failed" | tee -a "$out/gpu_check.log"
    rm -rf "$results"
fi
echo "gpu_run: gpu_check exit $rc; files in $out:"
ls -la "$out"
exit "$rc"
