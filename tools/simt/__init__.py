# SPDX-License-Identifier: Apache-2.0
"""Host SIMT emulation of the CUDA kernels (see simt.h and harness.py)."""
