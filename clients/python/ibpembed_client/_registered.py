# SPDX-License-Identifier: Apache-2.0
"""Regions this client registered, and requests that read from or write to them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ibpembed_client.regions import SharedMemoryRegion
from ibpembed_client.v1 import lookup_pb2 as pb


@dataclass(frozen=True)
class RegisteredRegion:
    """A region this client registered: its memory and where the region starts in it."""

    memory: SharedMemoryRegion
    offset: int
    byte_size: int


def move_inputs_to_region(
    request: pb.LookupRequest, regions: Mapping[str, RegisteredRegion], name: str, offset: int = 0
) -> pb.LookupRequest:
    """``request`` with its features' ids, lengths and weights moved into registered region
    ``name`` from ``offset`` (the layout of ``InputRegion``): the request then carries the
    feature names and counts only. Raises ValueError when they do not fit the region."""
    region = regions.get(name)
    if region is None:
        raise ValueError(f"input_region {name!r} was not registered through this client")
    features = request.features
    ids = b"".join([f.ids for f in features])
    lengths = b"".join([f.lengths for f in features])
    weighted = any(f.weights for f in features)
    weights = b""
    if weighted:
        weights = b"".join(
            [f.weights or np.ones(len(f.ids) // 8, dtype="<f4").tobytes() for f in features]
        )
    size = len(ids) + len(lengths) + len(weights)
    if offset < 0 or offset + size > region.byte_size:
        raise ValueError(
            f"the inputs are {size} bytes from offset {offset}, past the end of region {name!r}"
            f" ({region.byte_size} bytes)"
        )
    start = region.offset + offset
    region.memory.write(start, ids)
    region.memory.write(start + len(ids), lengths)
    if weights:
        region.memory.write(start + len(ids) + len(lengths), weights)
    spec = request.input_region
    spec.name, spec.offset, spec.weighted = name, offset, weighted
    spec.num_ids.extend([len(f.ids) // 8 for f in features])
    spec.batch_sizes.extend([len(f.lengths) // 4 for f in features])
    for f in features:
        f.ClearField("ids")
        f.ClearField("lengths")
        f.ClearField("weights")
    return request


def region_of(
    regions: Mapping[str, RegisteredRegion], request: pb.LookupRequest
) -> RegisteredRegion | None:
    """The registered region a request's outputs go to (None: in the response)."""
    if not request.HasField("output_region"):
        return None
    region = regions.get(request.output_region.name)
    if region is None:
        raise ValueError(
            f"output_region {request.output_region.name!r} was not registered through this "
            "client (register_region): its memory is needed to view the results"
        )
    return region


def region_registration(
    name: str, memory: SharedMemoryRegion, offset: int, byte_size: int | None
) -> tuple[pb.RegisterRegionRequest, RegisteredRegion]:
    """The RegisterRegion request for ``[offset, offset + byte_size)`` of ``memory`` (default:
    to its end), and what the client keeps to view results in it."""
    size = memory.size - offset if byte_size is None else byte_size
    request = pb.RegisterRegionRequest(
        name=name,
        kind=pb.REGION_KIND_SYSTEM_SHM,
        shm_name=memory.shm_name,
        offset=offset,
        byte_size=size,
    )
    return request, RegisteredRegion(memory, offset, size)
