# SPDX-License-Identifier: Apache-2.0
"""The client's SharedMemoryRegion: real POSIX shm, views without copies, bounds, and who
unlinks the object."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from ibpembed_client import SharedMemoryRegion


def _name() -> str:
    return f"/ibpembed-client-test-{uuid.uuid4().hex[:10]}"


def test_views_alias_the_object_and_outlive_close():
    name = _name()
    shm = SharedMemoryRegion.create(name, 8192)
    other = SharedMemoryRegion(name, 8192)  # a second mapping of the same object
    view = shm.array(128, np.dtype("<f4"), (4, 8))
    view[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert np.array_equal(other.array(128, np.dtype("<f4"), (4, 8)), view)
    end = shm.write(1024, np.arange(5, dtype=np.int64))
    assert end == 1024 + 40
    assert other.array(1024, np.dtype("<i8"), (5,)).tolist() == [0, 1, 2, 3, 4]
    other.close()
    assert os.path.exists("/dev/shm" + name)  # only the creator unlinks
    shm.close()
    shm.close()  # twice is fine
    assert not os.path.exists("/dev/shm" + name)
    assert view.sum() == sum(range(32))  # the view kept its mapping


def test_mode_is_exact():
    name = _name()
    with SharedMemoryRegion.create(name, 64, mode=0o660):
        assert os.stat("/dev/shm" + name).st_mode & 0o777 == 0o660


def test_bounds_and_names():
    with SharedMemoryRegion.create(_name(), 4096) as shm:
        with pytest.raises(ValueError, match="outside"):
            shm.array(4000, np.dtype("<f4"), (100,))
        with pytest.raises(ValueError, match="outside"):
            shm.write(4090, b"12345678")
    for bad in ("no-slash", "/a/b", "/"):
        with pytest.raises(ValueError, match="POSIX shm name"):
            SharedMemoryRegion(bad, 16)
    with pytest.raises(FileExistsError):
        name = _name()
        with SharedMemoryRegion.create(name, 16):
            SharedMemoryRegion.create(name, 16)
