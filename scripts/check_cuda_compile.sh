#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Compile check of the CUDA path on machines without a GPU or a CUDA build of torch: every
# csrc/cuda/*.cu (and the benchmark baseline benchmarks/cuda/*.cu) through nvcc -c for sm_80 and
# sm_90 (-gencode, as setup.py builds them) with -Xptxas -v, and every host file that goes with
# them (csrc/ops/*_cuda.cpp, benchmarks/cuda/*.cpp) through g++ -c, against the venv's torch
# headers.
# Nothing is linked: the CPU torch wheel has no libtorch_cuda. Prints each kernel's registers,
# spills and shared memory; exits non-zero on any compiler error or on a register spill.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
NVCC=${NVCC:-nvcc}
CXX=${CXX:-g++}
TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")}
# The CUDA include dir: the toolkit's, or the one nvcc wrappers point at.
CUDA_INC=${CUDA_INC:-$CUDA_HOME/include}
[ -f "$CUDA_INC/cuda_runtime_api.h" ] || CUDA_INC=/usr/local/cuda/include

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

INCLUDES=(-Icsrc/include -isystem "$TORCH_DIR/include"
          -isystem "$TORCH_DIR/include/torch/csrc/api/include")
# The CPU wheel's c10/cuda headers lack the generated cmake config (docs: environment.md).
DEFINES=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DC10_CUDA_BUILD_SHARED_LIBS -DIBPEMBED_WITH_CUDA=1)
GENCODE=(-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
         -gencode=arch=compute_90,code=compute_90)

status=0
for cu in csrc/cuda/*.cu benchmarks/cuda/*.cu; do
  log="$OUT/$(basename "$cu").log"
  echo "== nvcc $cu (sm_80, sm_90)"
  if ! "$NVCC" -std=c++17 -O3 --expt-relaxed-constexpr "${GENCODE[@]}" -Xptxas -v \
      "${INCLUDES[@]}" "${DEFINES[@]}" -c "$cu" -o "$OUT/$(basename "$cu").o" >"$log" 2>&1; then
    cat "$log"
    status=1
    continue
  fi
  grep -Ev 'ptxas info *: (Function properties|Compiling entry function)|^$' "$log" \
    | grep -Ev 'ptxas info *: Used|bytes stack frame' || true
  # One line per kernel and arch: demangled name, registers, spills, static shared memory.
  awk '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/);
                                 fn = substr($0, RSTART + 1, RLENGTH - 2);
                                 match($0, /sm_[0-9]+/); arch = substr($0, RSTART, RLENGTH) }
    /bytes stack frame/ { frame = $0; sub(/^[ \t]+/, "", frame) }
    /ptxas info *: Used/ { used = $0; sub(/.*Used/, "Used", used);
                           printf "%s\t%s\t%s\t%s\n", arch, fn, used, frame }
  ' "$log" | while IFS=$'\t' read -r arch fn used frame; do
    name=$(echo "$fn" | c++filt | sed -E 's/^void //; s/\(anonymous namespace\):://g; s/\(.*$//')
    printf '  %-6s %-38s %s | %s\n' "$arch" "$name" "$used" "$frame"
  done
  if grep -Eq '[1-9][0-9]* bytes spill (stores|loads)' "$log"; then
    echo "ERROR: register spills in $cu" >&2
    status=1
  fi
done

for cpp in csrc/ops/*_cuda.cpp benchmarks/cuda/*.cpp; do
  echo "== $CXX $cpp"
  if ! "$CXX" -std=c++17 -O1 -fPIC -Wall -Wextra -Wno-unused-parameter -isystem "$CUDA_INC" \
      "${INCLUDES[@]}" "${DEFINES[@]}" -c "$cpp" -o "$OUT/$(basename "$cpp").o"; then
    status=1
  fi
done

if [ "$status" -ne 0 ]; then
  echo "CUDA compile check FAILED" >&2
else
  echo "CUDA compile check passed"
fi
exit "$status"
