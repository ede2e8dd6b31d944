# SPDX-License-Identifier: Apache-2.0
"""Builds ibpembed._C from csrc/: the CPU codec always, the CUDA kernels when torch has CUDA.

Four translation units get ISA flags, each its own: csrc/codec/row_kernels_bmi2.cpp (-mbmi2),
csrc/codec/row_kernels_avx512.cpp (BMI2 + AVX-512), csrc/lookup/accumulate_avx2.cpp (-mavx2) and
csrc/lookup/accumulate_avx512.cpp (-mavx512f).
They are built to objects first and linked in, because setuptools has no per-file flags. Which
path runs is chosen at load time, never here.
Set IBPEMBED_SKIP_CUDA_BUILD=1 to build the CPU extension on a CUDA torch.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"
# Sources compiled with their own ISA flags (torch-free, so plain compiler calls build them).
ISA_SOURCES = {
    "csrc/codec/row_kernels_bmi2.cpp": ["-mbmi2"],
    "csrc/codec/row_kernels_avx512.cpp": [
        "-mbmi2",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vbmi",
        "-mavx512vbmi2",
        # GCC 12's own vpermb/vpmultishiftqb intrinsics warn about their undefined operand.
        "-Wno-maybe-uninitialized",
    ],
    "csrc/lookup/accumulate_avx2.cpp": ["-mavx2"],
    "csrc/lookup/accumulate_avx512.cpp": ["-mavx512f"],
}
CXX_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    # No FMA contraction anywhere: a pooled sum multiplies then adds each element, as the CUDA
    # kernels do (accumulate.h). GCC contracts C++ by default (-std=c++17 included), and FMA is
    # in the baseline of aarch64 (the portable loop) and of -mavx512f (accumulate_avx512.cpp).
    "-ffp-contract=off",
]


# The torch-facing sources split work with at::parallel_for, which runs serially without OpenMP
# (csrc/ops/parallel.h). Compile flag only: the runtime is the libgomp torch already loads.
OPENMP_FLAGS = (
    ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
)


def host_isa_sources() -> dict[str, list[str]]:
    """ISA_SOURCES on x86-64; none elsewhere (aarch64: Graviton, Grace build the portable path
    only)."""
    return ISA_SOURCES if platform.machine().lower() in ("x86_64", "amd64") else {}


def _sources(pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.glob(pattern))


def _cuda_enabled() -> bool:
    if os.environ.get("IBPEMBED_SKIP_CUDA_BUILD") == "1":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _gencode() -> list[str]:
    """sm_80 and sm_90 images plus compute_90 PTX, so that GPUs newer than sm_90 JIT-compile the
    kernels instead of finding no image (the kernels need sm_80: cp.async, __reduce_add_sync).
    IBPEMBED_CUDA_ARCHS=90 (comma-separated) builds only those images, e.g. on the GPU machine
    itself, where each extra target costs build time."""
    archs = os.environ.get("IBPEMBED_CUDA_ARCHS")
    if archs:
        return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(",")]
    return [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


class BuildExtension(cpp_extension.BuildExtension):
    """Compiles the ISA-specific translation units with their own flags, then builds as usual."""

    def build_extensions(self) -> None:
        include = str(CSRC / "include")
        objects = []
        for source, isa_flags in host_isa_sources().items():
            objects += self.compiler.compile(
                [source],
                output_dir=self.build_temp,
                include_dirs=[include],
                extra_postargs=[*CXX_FLAGS, "-fPIC", *isa_flags],
            )
        for ext in self.extensions:
            ext.extra_objects = [*ext.extra_objects, *objects]
        super().build_extensions()


def _extension() -> cpp_extension.CppExtension:
    sources = [
        s for s in _sources("codec/*.cpp") + _sources("lookup/*.cpp") if s not in ISA_SOURCES
    ]
    # ops/: the registration file and the CPU impls; *_cuda.cpp only in CUDA builds (below).
    sources += [s for s in _sources("ops/*.cpp") if not s.endswith("_cuda.cpp")]
    include_dirs = [str(CSRC / "include")]
    if not _cuda_enabled():
        return cpp_extension.CppExtension(
            "ibpembed._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": CXX_FLAGS + OPENMP_FLAGS},
        )
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *_gencode()]
    sources += _sources("cuda/*.cu") + _sources("ops/*_cuda.cpp")
    return cpp_extension.CUDAExtension(
        "ibpembed._C",
        sources,
        include_dirs=include_dirs,
        define_macros=[("IBPEMBED_WITH_CUDA", "1")],
        extra_compile_args={"cxx": CXX_FLAGS + OPENMP_FLAGS, "nvcc": nvcc_flags},
    )


# setuptools runs this file as __main__; tools that need the flags above read them with
# runpy.run_path (tests/codec/test_isa_objects.py, benchmarks/gpu_check, the aarch64 check).
if __name__ == "__main__":
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension})
