#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Compile check of the CPU extension for aarch64 (Graviton, Grace hosts), which builds the
# portable path only: every csrc .cpp that setup.py builds on such a host (all but its x86-only
# ISA_SOURCES and the CUDA glue) through aarch64-linux-gnu-g++ -c with setup.py's CXX_FLAGS,
# against the venv's torch headers, warnings as errors; then checks that nothing asks for the
# x86-only row kernels and that no fused multiply-add was emitted (FMA is in aarch64's baseline:
# a contracted pooled sum would differ from the CUDA kernels' bits, accumulate.h).
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
SETUP=$("$PY" - <<'PYEOF'
import runpy
from pathlib import Path

setup = runpy.run_path("setup.py")  # setup.py builds only as __main__
print(" ".join(setup["CXX_FLAGS"]))
for pattern in ("csrc/codec/*.cpp", "csrc/lookup/*.cpp", "csrc/ops/*.cpp"):
    for path in sorted(Path(".").glob(pattern)):
        if str(path) not in setup["ISA_SOURCES"] and not path.name.endswith("_cuda.cpp"):
            print(path)
PYEOF
)
read -r -a CXX_FLAGS <<<"$(head -n 1 <<<"$SETUP")"
mapfile -t SOURCES < <(tail -n +2 <<<"$SETUP")
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
FLAGS=("${CXX_FLAGS[@]}" -fPIC -fopenmp -Werror
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
# Scalar fmadd/fmsub/fnmadd/fnmsub, vector fmla/fmls and fmlal/fmlsl, bfloat16 bfmlalb/bfmlalt.
FUSED='^\s*[0-9a-f]+:\s+(f(n)?m(add|sub)|fml[as]|bfml[as])'
fused=0
for obj in "$OUT"/*.o; do
  if count=$("${CXX%g++}objdump" -d --no-show-raw-insn "$obj" | grep -cE "$FUSED"); then
    echo "$(basename "$obj" .o): $count fused multiply-adds" >&2
    fused=1
  fi
done
if ((fused)); then
  echo "aarch64 objects fuse multiply-adds (setup.py's CXX_FLAGS must keep -ffp-contract=off)" >&2
  exit 1
fi
echo "aarch64 compile check passed (${#SOURCES[@]} files)"
