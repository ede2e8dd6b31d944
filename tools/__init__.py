# SPDX-License-Identifier: Apache-2.0
"""What tests, benchmarks and reliability campaigns share: the SIMT emulator, a server process,
hostile inputs, a table's op arguments placed for the CUDA ops."""
