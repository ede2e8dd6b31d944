# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the codec tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# Loaded before the extension, which links against the libraries torch loads: this conftest is
# imported before any test module of the folder, and `import ibpembed` does not import torch (the
# CLI starts without it).
import torch  # noqa: F401

from ibpembed import _C, cpu_path


@pytest.fixture
def restore_path() -> Iterator[None]:
    """Tests that switch the process's CPU path get the original one back."""
    before = cpu_path()
    yield
    _C.set_cpu_path(before)
