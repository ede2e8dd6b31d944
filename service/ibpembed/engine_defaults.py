# SPDX-License-Identifier: Apache-2.0
"""The engine's defaults that the server's settings show (``ibpembed serve --help``, the README
table). A module of its own, outside :mod:`ibpembed.engine`, because that package imports torch
(over a second) and ``serve --help`` needs none of it."""

from __future__ import annotations

from typing import Literal

# Pooled lookups of a table with fewer ids go straight to the fused kernel, whose per-call cache
# decodes most repeated ids once (csrc codec.h's RepeatCache): sorting the ids to find every
# repeat only pays when there are far more distinct rows than that cache holds (see
# LookupEngine's dedupe_min_ids).
DEDUPE_MIN_IDS = 32768
# Requests with at most this many ids run on the calling (event-loop) thread instead of a
# worker: handing a request to a worker thread and back costs more than their kernels
# (docs/serving.md, *The thread hand-off*, measured with benchmarks.service --handoff).
INLINE_MAX_IDS = 256
# The server's default --hot-tier (spellings: ibpembed.tables.tier_budget).
DEFAULT_TIER = "1%"
# How the HBM tier stores a row (ibpembed.engine.hbm_tier): decoded, or as the table stores it.
TierForm = Literal["decoded", "compressed"]
FORMS: tuple[TierForm, ...] = ("decoded", "compressed")
DEFAULT_FORM: TierForm = "decoded"
