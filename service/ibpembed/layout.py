# SPDX-License-Identifier: Apache-2.0
"""The compact layout in Python: its constants, read from the C++ header through ``_C``, and the
byte arithmetic every report uses (a table, a packed file, the store's accounting, torchrec's).

One place on purpose: a format change (a new layout version, a new dtype) then touches this
module and csrc/include/ibpembed/format.h, and nothing else has to know the numbers.
"""

from __future__ import annotations

import torch

from ibpembed import _C

FORMAT_VERSION = int(_C.FORMAT_VERSION)
ROWS_PER_BLOCK = int(_C.ROWS_PER_BLOCK)  # rows per index block (block_base entry)
PAYLOAD_PAD = int(_C.PAYLOAD_PAD)  # zero bytes past a payload's end the decoders may read
MAX_UNITS_PER_ROW = int(_C.MAX_UNITS_PER_ROW)  # a row's slot size in units fits a uint8
MAX_SLOT_UNIT = int(_C.MAX_SLOT_UNIT)  # the largest slot unit (alignment) a table may ask for
MAX_ROW_BYTES = int(_C.MAX_ROW_BYTES)  # the widest row the codec holds (16384 fp32 elements)
INT8_ROWWISE_HEADER_BYTES = int(_C.INT8_ROWWISE_HEADER_BYTES)  # fp16 scale + fp16 bias
BITMASK_WORD_ROWS = 32  # rows per int32 word of the compressed-row bitmask
TIER_WORD_ROWS = int(_C.TIER_WORD_ROWS)  # table rows per bit word of a tier's rank directory

# ibpembed::DType (format.h); the row-wise int8 code marks uint8 rows with a scale/bias header.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: int(_C.DTYPE_FLOAT32),
    torch.float16: int(_C.DTYPE_FLOAT16),
    torch.bfloat16: int(_C.DTYPE_BFLOAT16),
    torch.uint8: int(_C.DTYPE_UINT8),
    torch.int8: int(_C.DTYPE_INT8),
}
INT8_ROWWISE_CODE = int(_C.DTYPE_INT8_ROWWISE)
# ibpembed::Pooling (format.h): the pooling argument of the pooled-lookup ops.
POOLING_CODES: dict[str, int] = {"sum": int(_C.POOLING_SUM), "mean": int(_C.POOLING_MEAN)}


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def num_chunks(row_bytes: int, chunk_bits: int) -> int:
    """Chunks (mask words) a row splits into."""
    return ceil_div(row_bytes, chunk_bits // 8)


def codebook_entries(chunks: int, code_bits: int) -> int:
    """Length of a table's bitval: one codebook of 2^C - 1 patterns per chunk."""
    return chunks * ((1 << code_bits) - 1)


def num_blocks(num_rows: int) -> int:
    return ceil_div(num_rows, ROWS_PER_BLOCK)


def bitmask_words(num_rows: int) -> int:
    return ceil_div(num_rows, BITMASK_WORD_ROWS)


def index_bytes(num_rows: int) -> int:
    """The random-access index: one int64 base per block (and one past the end), one uint8 slot
    size per row of every block."""
    blocks = num_blocks(num_rows)
    return 8 * (blocks + 1) + blocks * ROWS_PER_BLOCK


def metadata_bytes(num_rows: int, chunks: int, code_bits: int) -> int:
    """The compressed-row bitmask and the per-chunk masks and codebooks."""
    return 4 * bitmask_words(num_rows) + 8 * (chunks + codebook_entries(chunks, code_bits))


def savings(stored_bytes: int, raw_bytes: int) -> float:
    """1 - stored / raw: the fraction of host bytes saved (negative when metadata dominates)."""
    return 1.0 - stored_bytes / raw_bytes
