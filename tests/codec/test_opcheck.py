# SPDX-License-Identifier: Apache-2.0
"""torch.library.opcheck on every op: schema, fake kernels, dispatcher registration."""

from __future__ import annotations

import pytest
import torch

from ibpembed import compress
from ibpembed._ops import ops

TABLE = compress(torch.randn(70, 12).to(torch.bfloat16).float())
CODED = compress(torch.randn(70, 12).to(torch.bfloat16).float(), chunk_bits=32, code_bits=3)
ROWS = torch.randn(70, 12).view(torch.uint8).reshape(70, -1)


def _cases() -> list[tuple[str, tuple]]:
    args = TABLE.op_args()
    ids = torch.tensor([3, 69, 3, 0])
    hot = CODED.with_hot_rows(torch.tensor([1, 5, 64, 69])).hot
    assert hot is not None
    return [
        ("ibp_fit", (ROWS, 32, "ibpembed")),
        ("ibp_fit", (ROWS, 16, "ibpembed", 3)),
        ("ibp_fit_codebooks", (ROWS, 32, [2, 4])),
        ("ibp_decompress", CODED.op_args()),
        ("ibp_gather", (*CODED.op_args(), torch.tensor([5, 1, 5]))),
        ("ibp_gather", (*CODED.op_args(), torch.tensor([5, 2, 69]), hot.directory, hot.rows)),
        (
            "lookup_pooled",
            (*CODED.op_args(), ids, torch.tensor([0, 1, 4]), None, 0, 0, hot.directory, hot.rows),
        ),
        ("ibp_slot_bytes", (ROWS, TABLE.chunk_bits, TABLE.mask, TABLE.bitval, TABLE.unit_bytes)),
        ("ibp_compress", (ROWS, TABLE.chunk_bits, TABLE.mask, TABLE.bitval, TABLE.unit_bytes)),
        (
            "ibp_line_aware",
            (*CODED.op_args()[:3], CODED.row_bytes, CODED.unit_bytes, CODED.num_rows),
        ),
        ("ibp_decompress", args),
        ("ibp_gather", (*args, ids)),
        ("lookup_pooled", (*args, ids, torch.tensor([0, 1, 4]), None, 0, 0)),
        ("lookup_pooled", (*args, ids, torch.tensor([0, 4]), torch.rand(4), 0, 1)),
    ]


@pytest.mark.parametrize(("name", "args"), _cases(), ids=lambda c: str(c)[:30])
def test_opcheck(name: str, args: tuple) -> None:
    op = getattr(ops, name).default
    if name in ("ibp_compress", "ibp_line_aware"):
        # A data-dependent payload size: the dynamic-shape AOT check does not apply.
        tests = ("test_schema", "test_autograd_registration", "test_faketensor")
        torch.library.opcheck(op, args, test_utils=tests)
    else:
        torch.library.opcheck(op, args)
