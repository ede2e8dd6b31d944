# SPDX-License-Identifier: Apache-2.0
"""Conversion between ``ibpembed.v1`` messages and the engine's types.

Requests are checked and decoded into the engine's :class:`~ibpembed.engine.FeatureQuery` or
:class:`~ibpembed.engine.PackedRequest` (from the message's bytes fields, or from an input
region); results are encoded as ``LookupResponse`` wire bytes, or written into an output region
with a response that says where. Errors are :mod:`ibpembed.errors`, naming the field.

Responses are written straight from the result tensors. A pooled B=2048 response of 26 features
is 27 MB of values. Through protobuf they are copied three times (``tobytes``, into the message,
into the serialized string), on the event loop thread for the serialization: 27-33 ms of CPU per
response, where :func:`lookup_response_bytes` takes about 3 ms (development measurement, without
the server's malloc settings), one copy from the tensors into the final ``bytes`` (a
``bytes.join`` of small headers and the tensors' own buffers), on the worker thread that ran the
lookup.

The bytes are exactly what ``LookupResponse.SerializeToString()`` gives for the same message
(fields in number order, proto3 defaults left out, ``shape`` packed): the tests compare them
byte for byte, so clients parse them with the generated classes as before. Only the lookup
responses are written here; every other message goes through protobuf.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ibpembed.engine import (
    FeatureQuery,
    LookupResult,
    PackedRequest,
    Pooling,
    Request,
    TableDescription,
)
from ibpembed.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from ibpembed.server.regions import Region, RegionInfo, output_layout
from ibpembed.server.status import MAX_REQUEST_ID_CHARS, UndecodableRequest
from ibpembed_client.v1 import lookup_pb2 as pb

POOLING: dict[int, Pooling] = {
    pb.POOLING_UNSPECIFIED: "sum",
    pb.POOLING_SUM: "sum",
    pb.POOLING_MEAN: "mean",
    pb.POOLING_NONE: "none",
}
DTYPES: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.uint8: pb.DTYPE_UINT8,
    torch.int8: pb.DTYPE_INT8,
    torch.int32: pb.DTYPE_INT32,
    torch.int64: pb.DTYPE_INT64,
}

_OUTPUT_DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_UNSPECIFIED: torch.float32,
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
}
REGION_KINDS = {pb.REGION_KIND_UNSPECIFIED, pb.REGION_KIND_SYSTEM_SHM, pb.REGION_KIND_CUDA_IPC}

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


def value_bytes(values: torch.Tensor) -> memoryview:
    """The little-endian values of a contiguous tensor as a buffer (a view of a numpy view, no
    copy: ``bytes.join`` and ``os.pwritev`` take it as it is; its ``nbytes`` is its size)."""
    if values.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are what count
        values = values.view(torch.int16)
    # The array's memoryview rather than the array: numpy's stubs make an array a buffer only
    # from Python 3.12 on.
    return values.numpy().data


def lookup_response_bytes(
    request_id: str,
    table_version: int,
    features: Sequence[tuple[str, int, torch.Tensor]],
) -> bytes:
    """Serialized ``LookupResponse``: ``features`` are (name, ``DType`` value, values), the
    values' shape and little-endian bytes (any dtype; made contiguous) becoming the
    ``FeatureOutput``."""
    parts: list[bytes | memoryview] = []
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


def output_dtype_of(request: pb.LookupRequest) -> torch.dtype:
    """The request's ``output_dtype``: pooled results only, FLOAT32 / FLOAT16 / BFLOAT16."""
    if request.output_dtype not in _OUTPUT_DTYPES:
        raise InvalidArgument(
            "output_dtype", f"{request.output_dtype}: must be FLOAT32, FLOAT16 or BFLOAT16"
        )
    if request.output_dtype != pb.DTYPE_UNSPECIFIED and request.pooling == pb.POOLING_NONE:
        raise InvalidArgument(
            "output_dtype",
            "pooling NONE returns rows bit-exact in the table's dtype: leave it unset",
        )
    return _OUTPUT_DTYPES[request.output_dtype]


def _array(data: bytes, dtype: str, field: str) -> np.ndarray:
    """A read-only little-endian view of ``data``; the byte count must fit the element size."""
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise InvalidArgument(
            field, f"{len(data)} bytes is not a whole number of {itemsize}-byte {dtype} values"
        )
    return np.frombuffer(data, dtype=dtype)


def check_request(request: pb.LookupRequest) -> None:
    if isinstance(request, UndecodableRequest):  # a LookupStream message that did not parse
        raise request.error()
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # echoed in the response and the logs
        raise InvalidArgument(
            "request_id", f"{len(request.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}"
        )
    if request.pooling not in POOLING:
        raise InvalidArgument("pooling", f"unknown value {request.pooling}")


def decode_request(request: pb.LookupRequest) -> tuple[list[FeatureQuery], Pooling]:
    """Features and pooling of a request; :class:`InvalidArgument` for undecodable fields."""
    check_request(request)
    features = []
    for i, feature in enumerate(request.features):
        if not feature.name:
            raise InvalidArgument(f"features[{i}].name", "empty feature name")
        weights = None
        if feature.weights:
            weights = _array(feature.weights, "<f4", f"features[{i}].weights")
        features.append(
            FeatureQuery(
                name=feature.name,
                ids=_array(feature.ids, "<i8", f"features[{i}].ids"),
                lengths=_array(feature.lengths, "<i4", f"features[{i}].lengths"),
                weights=weights,
            )
        )
    return features, POOLING[request.pooling]


def decode_packed(
    request: pb.LookupRequest, names: list[str] | None = None
) -> PackedRequest | None:
    """The request's features as one array each (:class:`PackedRequest`), or None for one that
    :func:`decode_request` must decode feature by feature: weighted, or malformed (it names the
    field). Call after :func:`check_request`. ``names``: the features' names, when the caller
    has them already (each costs a message wrapper to read).

    NOTE(server): one join per field instead of per-feature arrays and objects: at B=1 x 26
    decoding the features one by one cost more than their kernels.
    """
    features = request.features
    if names is None:
        names = [f.name for f in features]
    if not all(names) or any(f.weights for f in features):
        return None
    ids_parts = [f.ids for f in features]
    length_parts = [f.lengths for f in features]
    count = len(names)
    id_bytes = np.fromiter(map(len, ids_parts), dtype=np.int64, count=count)
    length_bytes = np.fromiter(map(len, length_parts), dtype=np.int64, count=count)
    if (id_bytes % 8).any() or (length_bytes % 4).any():
        return None
    return PackedRequest(
        names=names,
        # bytearray: writable memory the kernels may take (and shards shift).
        ids=np.frombuffer(bytearray().join(ids_parts), dtype="<i8"),
        lengths=np.frombuffer(b"".join(length_parts), dtype="<i4"),
        id_counts=id_bytes // 8,
        sample_counts=length_bytes // 4,
    )


def decode_features(
    request: pb.LookupRequest, names: list[str] | None = None
) -> tuple[Request, Pooling]:
    """A request's features from its bytes fields: packed (one array per field) where it can
    be, else feature by feature. Call after :func:`check_request`; ``names`` as for
    :func:`decode_packed`."""
    packed = decode_packed(request, names) if request.pooling != pb.POOLING_NONE else None
    if packed is not None:
        return packed, POOLING[request.pooling]
    return decode_request(request)


def decode_region_inputs(
    request: pb.LookupRequest, region: Region, max_bytes: int | None = None
) -> tuple[list[FeatureQuery], Pooling]:
    """Features whose ids, lengths and weights are in ``region`` (``request.input_region``).

    ``max_bytes``: the most input bytes read (the server's message limit, which bounds the same
    inputs sent in the request); more is RESOURCE_EXHAUSTED before anything is read."""
    check_request(request)
    spec = request.input_region
    count = len(request.features)
    if len(spec.num_ids) != count or len(spec.batch_sizes) != count:
        raise InvalidArgument(
            "input_region.num_ids",
            f"num_ids and batch_sizes need one entry per feature ({count}), got "
            f"{len(spec.num_ids)} and {len(spec.batch_sizes)}",
        )
    if spec.weighted and request.pooling == pb.POOLING_NONE:
        raise InvalidArgument("input_region.weighted", "weights need pooling SUM or MEAN")
    num_ids = np.asarray(spec.num_ids, dtype=np.int64)
    batch = np.asarray(spec.batch_sizes, dtype=np.int64)
    if count and (num_ids.min() < 0 or batch.min() < 0):
        raise InvalidArgument("input_region.num_ids", "counts must be non-negative")
    # Python integers: an int64 sum of huge counts wraps (to 0, even), and the size check below
    # would pass.
    total_ids, total_samples = sum(spec.num_ids), sum(spec.batch_sizes)
    size = total_ids * (12 if spec.weighted else 8) + total_samples * 4
    if spec.offset > region.info.byte_size or size > region.info.byte_size - spec.offset:
        raise InvalidArgument(
            "input_region.offset",
            f"the inputs are {size} bytes from offset {spec.offset}, past the end of region "
            f"{region.info.name!r} ({region.info.byte_size} bytes)",
        )
    if max_bytes is not None and size > max_bytes:
        raise ResourceExhausted(
            f"input_region.num_ids: the inputs are {size} bytes, over the server's message limit"
            f" of {max_bytes} bytes (--max-message-mb), which bounds inputs read from a region as"
            " it does those sent in a request: send fewer ids per request"
        )
    for i, feature in enumerate(request.features):
        if feature.ids or feature.lengths or feature.weights:
            raise InvalidArgument(
                f"features[{i}]", "ids, lengths and weights must be empty with input_region"
            )
    region.check("input_region.name")
    data = region.read(spec.offset, size, "input_region.name")
    ids = np.frombuffer(data, "<i8", total_ids)
    lengths = np.frombuffer(data, "<i4", total_samples, offset=total_ids * 8)
    weights = (
        np.frombuffer(data, "<f4", total_ids, offset=total_ids * 8 + total_samples * 4)
        if spec.weighted
        else None
    )
    id_ends, sample_ends = np.cumsum(num_ids).tolist(), np.cumsum(batch).tolist()
    features = []
    id_start = sample_start = 0
    for i, feature in enumerate(request.features):
        if not feature.name:
            raise InvalidArgument(f"features[{i}].name", "empty feature name")
        id_end, sample_end = id_ends[i], sample_ends[i]
        features.append(
            FeatureQuery(
                name=feature.name,
                ids=ids[id_start:id_end],
                lengths=lengths[sample_start:sample_end],
                weights=None if weights is None else weights[id_start:id_end],
            )
        )
        id_start, sample_start = id_end, sample_end
    return features, POOLING[request.pooling]


# Fields whose values an input_region request reads from the region.
REGION_VALUE_FIELDS = (".ids", ".lengths", ".weights")


def region_values_invalid(field: str, request: pb.LookupRequest) -> InvalidArgument:
    """The refusal of inputs read from a region. It names the field only: the engine's own
    message quotes the bad value (an id, a sum of lengths), and a message quoting bytes of a
    region would let a caller read memory it could only name."""
    return InvalidArgument(
        field,
        f"the inputs read from region {request.input_region.name!r} are not valid here: each"
        " feature's lengths must be >= 0 and sum to its num_ids, and its ids must be rows of its"
        " table (ListTables); the values are not quoted",
    )


def encode_response(request_id: str, result: LookupResult) -> bytes:
    """The serialized ``LookupResponse`` (:mod:`ibpembed.server.wire`: raw little-endian values
    per feature, one memory copy)."""
    features = [(f.name, DTYPES[f.values.dtype], f.values) for f in result.features]
    return lookup_response_bytes(request_id, result.version, features)


@dataclass
class OutputWindow:
    """Where a request's outputs go: bytes [start, end) of a registered region.

    ``deadline`` (``time.monotonic()``) and ``ended`` (set by the servicer when the call is
    cancelled) say when the caller no longer waits for the values: its client has an error and
    may have reused the window for its next lookup, which a late write would overwrite.
    """

    region: Region
    start: int
    end: int
    deadline: float | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def write(self, request_id: str, result: LookupResult) -> tuple[bytes, int]:
        """Every feature's values into the window (or an error before any is written); the
        response bytes and the values' byte count."""
        values = [
            f.values if f.values.is_contiguous() else f.values.contiguous() for f in result.features
        ]
        sizes = [v.numel() * v.element_size() for v in values]
        offsets, end = output_layout(self.start, sizes)
        if end > self.end:
            raise InvalidArgument(
                "output_region.byte_size",
                f"the result needs bytes [{self.start}, {end}) of region "
                f"{self.region.info.name!r}, the request allows [{self.start}, {self.end})",
            )
        self.region.check("output_region.name")  # again: the lookup may have taken a while
        buffers: list[bytes | memoryview] = []
        position = self.start
        for offset, v, size in zip(offsets, values, sizes, strict=True):
            if offset > position:
                buffers.append(bytes(offset - position))  # alignment padding
            if size:
                buffers.append(value_bytes(v))
            position = offset + size
        # As late as can be: the kernels, the checks and the layout above may have outlived
        # the call. A write already under way when the call ends still finishes.
        if self.ended.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline):
            raise DeadlineExceeded(
                "the call ended (deadline passed or cancelled) before its values were written;"
                " its output window was left as it was"
            )
        self.region.write(self.start, buffers, "output_region.name")
        features = [
            (f.name, DTYPES[v.dtype], tuple(v.shape), offset)
            for f, v, offset in zip(result.features, values, offsets, strict=True)
        ]
        return region_response_bytes(request_id, result.version, features), sum(sizes)


def table_info(desc: TableDescription) -> pb.TableInfo:
    return pb.TableInfo(
        name=desc.name,
        num_rows=desc.num_rows,
        dim=desc.dim,
        dtype=DTYPES[desc.dtype],
        quant=desc.quant or "",
        raw_bytes=desc.raw_bytes,
        stored_bytes=desc.stored_bytes,
        chunk_bits=desc.chunk_bits,
        version=desc.version,
        row_start=desc.row_start,
        row_end=desc.row_end,
        features=list(desc.features),
    )


def region_info(info: RegionInfo) -> pb.RegionInfo:
    return pb.RegionInfo(
        name=info.name,
        kind=pb.REGION_KIND_SYSTEM_SHM,
        shm_name=info.shm_name,
        offset=info.offset,
        byte_size=info.byte_size,
    )
