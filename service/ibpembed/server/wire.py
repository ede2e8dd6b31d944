# SPDX-License-Identifier: Apache-2.0
"""``LookupResponse`` wire bytes written straight from the result tensors.

A pooled B=2048 response of 26 features is 27 MB of values. Through protobuf they are copied
three times (``tobytes``, into the message, into the serialized string), on the event loop
thread for the serialization: 27-33 ms of CPU per response, where :func:`lookup_response_bytes`
takes about 3 ms (development measurement, without the server's malloc settings), one copy from
the tensors into the final ``bytes`` (a ``bytes.join`` of small headers and the tensors' own
buffers), on the worker thread that ran the lookup.

The bytes are exactly what ``LookupResponse.SerializeToString()`` gives for the same message
(fields in number order, proto3 defaults left out, ``shape`` packed): the tests compare them
byte for byte, so clients parse them with the generated classes as before. Only the lookup
responses are written here; every other message goes through protobuf.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ibpembed_client.v1 import lookup_pb2 as pb

# Field keys: field number << 3 | wire type (0 varint, 2 length-delimited).
_RESPONSE_REQUEST_ID = b"\x0a"  # 1, string
_RESPONSE_FEATURE = b"\x12"  # 2, FeatureOutput
_RESPONSE_TABLE_VERSION = b"\x18"  # 3, uint64
_FEATURE_NAME = b"\x0a"  # 1, string
_FEATURE_DTYPE = b"\x10"  # 2, enum
_FEATURE_SHAPE = b"\x1a"  # 3, packed int64
_FEATURE_VALUES = b"\x22"  # 4, bytes
_FEATURE_REGION_OFFSET = b"\x28"  # 5, uint64


def _varint(value: int) -> bytes:
    """Base-128 varint; negative int64 values as their two's complement (10 bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(key: bytes, payload_size: int) -> bytes:
    return key + _varint(payload_size)


@functools.lru_cache(maxsize=4096)
def _feature_fields(name: str, dtype: int, shape: tuple[int, ...]) -> bytes:
    """A ``FeatureOutput``'s name, dtype and shape fields.

    NOTE(wire): cached because a frontend's requests repeat their features and batch size, and
    building these few bytes in Python cost more than copying a B=1 request's values.
    """
    head = bytearray()
    if name:
        encoded = name.encode()
        head += _length_delimited(_FEATURE_NAME, len(encoded)) + encoded
    if dtype:
        head += _FEATURE_DTYPE + _varint(dtype)
    if shape:
        packed = b"".join(_varint(size) for size in shape)
        head += _length_delimited(_FEATURE_SHAPE, len(packed)) + packed
    return bytes(head)


@functools.lru_cache(maxsize=4096)
def _feature_head(name: str, dtype: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """A ``FeatureOutput``'s key and length in the response, then its fields up to the values'
    bytes (which follow it on the wire)."""
    head = _feature_fields(name, dtype, shape)
    if nbytes:
        head += _length_delimited(_FEATURE_VALUES, nbytes)
    return _length_delimited(_RESPONSE_FEATURE, len(head) + nbytes) + head


@functools.lru_cache(maxsize=4096)
def _region_feature(name: str, dtype: int, shape: tuple[int, ...], offset: int) -> bytes:
    """A ``FeatureOutput`` whose values are in the output region, from ``offset`` (cached like
    :func:`_feature_fields`: a frontend reusing its windows repeats the offsets too)."""
    fields = _feature_fields(name, dtype, shape)
    if offset:
        fields += _FEATURE_REGION_OFFSET + _varint(offset)
    return _length_delimited(_RESPONSE_FEATURE, len(fields)) + fields


def region_response_bytes(
    request_id: str,
    table_version: int,
    features: Sequence[tuple[str, int, tuple[int, ...], int]],
) -> bytes:
    """Serialized ``LookupResponse`` of a request whose values went to its output region:
    ``features`` are (name, ``DType`` value, shape, region offset)."""
    parts: list[bytes] = []
    if request_id:
        encoded = request_id.encode()
        parts += [_length_delimited(_RESPONSE_REQUEST_ID, len(encoded)), encoded]
    for name, dtype, shape, offset in features:
        parts.append(_region_feature(name, dtype, shape, offset))
    if table_version:
        parts += [_RESPONSE_TABLE_VERSION, _varint(table_version)]
    return b"".join(parts)


def value_bytes(values: torch.Tensor) -> np.ndarray:
    """The little-endian values of a contiguous tensor as a buffer (a numpy view, no copy:
    ``bytes.join`` and ``os.pwritev`` take it as it is; its ``nbytes`` is its size)."""
    if values.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are what count
        values = values.view(torch.int16)
    return values.numpy()


def lookup_response_bytes(
    request_id: str,
    table_version: int,
    features: Sequence[tuple[str, int, torch.Tensor]],
) -> bytes:
    """Serialized ``LookupResponse``: ``features`` are (name, ``DType`` value, values), the
    values' shape and little-endian bytes (any dtype; made contiguous) becoming the
    ``FeatureOutput``."""
    parts: list[bytes | np.ndarray] = []
    if request_id:
        encoded = request_id.encode()
        parts += [_length_delimited(_RESPONSE_REQUEST_ID, len(encoded)), encoded]
    for name, dtype, values in features:
        if not values.is_contiguous():
            values = values.contiguous()
        nbytes = values.nbytes
        parts.append(_feature_head(name, dtype, tuple(values.shape), nbytes))
        if nbytes:
            parts.append(value_bytes(values))
    if table_version:
        parts += [_RESPONSE_TABLE_VERSION, _varint(table_version)]
    return b"".join(parts)


def serialize_response(response: bytes | pb.LookupResponse) -> bytes:
    """The lookup methods' response serializer: bytes from :func:`lookup_response_bytes` pass
    through; messages (a LookupStream request's ``Error``) go through protobuf."""
    return response if isinstance(response, bytes) else response.SerializeToString()
