# SPDX-License-Identifier: Apache-2.0
"""The codec's choices, defaults and limits as plain numbers, without torch.

``ibpembed.codec`` uses and re-exports them; command-line parsers read them from here so that
``ibpembed pack --help`` starts without importing torch (over a second).
"""

from __future__ import annotations

CHUNK_BITS_CHOICES = (64, 32, 16)
CODE_BITS_CHOICES = (1, 2, 3, 4)
DEFAULT_SAMPLE_ROWS = 1_000_000
DEFAULT_ALIGN: int | None = None  # None: the slot unit is chosen by measured size
MAX_SLOT_UNIT = 1 << 16  # format.h kMaxSlotUnit: the largest alignment a table may ask for
