// SPDX-License-Identifier: Apache-2.0
//
// at::parallel_for for this extension's kernels, or a build error where it would run serially.
//
// NOTE(ops): with torch's OpenMP backend, at::parallel_for is an inline template that only
// splits work in translation units compiled with -fopenmp; without the flag every call runs the
// whole range on the calling thread, silently (this extension's lookups, fits and compression
// did until setup.py passed it). The OpenMP runtime itself is torch's own libgomp, which
// libtorch_cpu already loads: the extension compiles with -fopenmp but does not link a second
// runtime.
#pragma once

#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile with -fopenmp (setup.py): torch's at::parallel_for would run serially here"
#endif
