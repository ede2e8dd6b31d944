#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Compile check of the CPU extension for aarch64 (Graviton, Grace hosts), which builds the
# portable path only: every csrc .cpp that setup.py builds on such a host (all but its x86-only
# ISA_SOURCES and the CUDA glue) through aarch64-linux-gnu-g++ -c, against the venv's torch
# headers, warnings as errors; then checks that nothing asks for the x86-only row kernels.
# Nothing is linked or run (no aarch64 torch here). Installs the cross compiler with apt when it
# can (root), else says so and exits 0: CI then simply lacks this check.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
CXX=${CXX_AARCH64:-aarch64-linux-gnu-g++}
if ! command -v "$CXX" >/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      g++-aarch64-linux-gnu >/dev/null
  else
    echo "check_aarch64_compile.sh: no $CXX (needs root to apt-get install it); skipped" >&2
    exit 0
  fi
fi
TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
PY_INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
mapfile -t SOURCES < <("$PY" - <<'PYEOF'
import runpy
from pathlib import Path

isa = runpy.run_path("setup.py")["ISA_SOURCES"]  # setup.py builds only as __main__
for pattern in ("csrc/codec/*.cpp", "csrc/lookup/*.cpp", "csrc/ops/*.cpp"):
    for path in sorted(Path(".").glob(pattern)):
        if str(path) not in isa and not path.name.endswith("_cuda.cpp"):
            print(path)
PYEOF
)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-O2 -std=c++17 -fPIC -fopenmp -Wall -Wextra -Wno-unused-parameter -Werror
       -Icsrc/include -isystem "$TORCH_DIR/include"
       -isystem "$TORCH_DIR/include/torch/csrc/api/include" -isystem "$PY_INC")
for src in "${SOURCES[@]}"; do
  echo "== $CXX $src"
  "$CXX" "${FLAGS[@]}" -c "$src" -o "$OUT/$(basename "$src").o"
done
NM=${CXX%g++}nm
if "$NM" -u "$OUT"/*.o | grep -E "bmi2_row_kernels|avx512_row_kernels|pool_rows_avx2"; then
  echo "aarch64 objects reference x86-only kernels" >&2
  exit 1
fi
echo "aarch64 compile check passed (${#SOURCES[@]} files)"
