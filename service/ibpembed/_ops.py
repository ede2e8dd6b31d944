# SPDX-License-Identifier: Apache-2.0
"""Loads the native extension (which registers torch.ops.ibpembed.*) and the ops' fake kernels.

Fake kernels give every op a shape function, so torch.compile, torch.export and
torch.library.opcheck can trace through them without running the codec. The one exception is
``lookup_pooled_tables``, whose first argument is a TorchScript object (``TableSet``, tables
registered once): the lookup engine calls it eagerly, and traced models use ``lookup_pooled``.
"""

from __future__ import annotations

import torch

from ibpembed import _C  # registers the ops
from ibpembed.layout import (
    INT8_ROWWISE_CODE,
    INT8_ROWWISE_HEADER_BYTES,
    ROWS_PER_BLOCK,
    bitmask_words,
    codebook_entries,
    num_blocks,
    num_chunks,
)

# The CPU path (IBPEMBED_CPU_PATH, or the CPU's fastest), the avx512 decoder's pattern lookup
# (IBPEMBED_PATTERN_LOOKUP) and the table size that stages reads (IBPEMBED_STAGE_MIN_BYTES)
# resolve on first use; resolve them now so that a bad value fails the import, not a server's
# first lookup.
_C.cpu_path()
_C.pattern_lookup()
_C.stage_min_bytes()

ops = torch.ops.ibpembed


def pooled_dim(dtype_code: int, row_bytes: int) -> int:
    """Number of fp32 outputs a row pools into; 0 when the dtype cannot be pooled."""
    if dtype_code == 0:
        return row_bytes // 4 if row_bytes % 4 == 0 else 0
    if dtype_code in (1, 2):
        return row_bytes // 2 if row_bytes % 2 == 0 else 0
    if dtype_code == INT8_ROWWISE_CODE:
        return max(row_bytes - INT8_ROWWISE_HEADER_BYTES, 0)
    return 0


@torch.library.register_fake("ibpembed::ibp_fit")
def _fit_fake(
    sample: torch.Tensor, chunk_bits: int, method: str, code_bits: int = 1
) -> tuple[torch.Tensor, ...]:
    v = num_chunks(sample.shape[1], chunk_bits)
    return sample.new_empty((v,), dtype=torch.int64), sample.new_empty(
        (codebook_entries(v, code_bits),), dtype=torch.int64
    )


@torch.library.register_fake("ibpembed::ibp_fit_codebooks")
def _fit_codebooks_fake(
    sample: torch.Tensor, chunk_bits: int, code_bits: list[int]
) -> list[torch.Tensor]:
    v = num_chunks(sample.shape[1], chunk_bits)
    out = []
    for c in code_bits:
        out.append(sample.new_empty((v,), dtype=torch.int64))
        out.append(sample.new_empty((codebook_entries(v, c),), dtype=torch.int64))
    return out


@torch.library.register_fake("ibpembed::ibp_slot_bytes")
def _slot_bytes_fake(rows, chunk_bits, mask, bitval, unit_bytes) -> torch.Tensor:
    return rows.new_empty((rows.shape[0],), dtype=torch.int64)


@torch.library.register_fake("ibpembed::ibp_compress")
def _compress_fake(rows, chunk_bits, mask, bitval, unit_bytes) -> tuple[torch.Tensor, ...]:
    n = rows.shape[0]
    blocks = num_blocks(n)
    payload_bytes = torch.library.get_ctx().new_dynamic_size()
    return (
        rows.new_empty((payload_bytes,), dtype=torch.uint8),
        rows.new_empty((blocks + 1,), dtype=torch.int64),
        rows.new_empty((blocks * ROWS_PER_BLOCK,), dtype=torch.uint8),
        rows.new_empty((bitmask_words(n),), dtype=torch.int32),
    )


@torch.library.register_fake("ibpembed::ibp_line_aware")
def _line_aware_fake(
    payload, block_base, row_units, row_bytes, unit_bytes, num_rows
) -> tuple[torch.Tensor, ...]:
    payload_bytes = torch.library.get_ctx().new_dynamic_size()
    return (
        payload.new_empty((payload_bytes,)),
        torch.empty_like(block_base),
        torch.empty_like(row_units),
    )


# Lookup outputs live where the table's small tensors live: on a GPU the payload stays in pinned
# host memory (a CPU tensor) while block_base and the rest are CUDA tensors.
@torch.library.register_fake("ibpembed::ibp_decompress")
def _decompress_fake(
    payload,
    block_base,
    row_units,
    bitmask,
    mask,
    bitval,
    chunk_bits,
    row_bytes,
    unit_bytes,
    num_rows,
) -> torch.Tensor:
    return block_base.new_empty((num_rows, row_bytes), dtype=torch.uint8)


@torch.library.register_fake("ibpembed::ibp_gather")
def _gather_fake(
    payload,
    block_base,
    row_units,
    bitmask,
    mask,
    bitval,
    chunk_bits,
    row_bytes,
    unit_bytes,
    num_rows,
    indices,
    tier_dir=None,
    tier_rows=None,
) -> torch.Tensor:
    return block_base.new_empty((indices.shape[0], row_bytes), dtype=torch.uint8)


@torch.library.register_fake("ibpembed::lookup_pooled")
def _lookup_pooled_fake(
    payload,
    block_base,
    row_units,
    bitmask,
    mask,
    bitval,
    chunk_bits,
    row_bytes,
    unit_bytes,
    num_rows,
    indices,
    offsets,
    per_sample_weights,
    dtype,
    pooling,
    tier_dir=None,
    tier_rows=None,
) -> torch.Tensor:
    return block_base.new_empty(
        (offsets.shape[0] - 1, pooled_dim(dtype, row_bytes)), dtype=torch.float32
    )
