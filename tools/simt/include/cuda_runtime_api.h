// SPDX-License-Identifier: Apache-2.0
//
// Stand-in for the CUDA runtime header when csrc/cuda's kernel headers compile for the host SIMT
// emulator (simt.h): kernels.h names cudaStream_t in its launcher declarations, nothing more.
#pragma once

using cudaStream_t = struct CUstream_st*;
