# SPDX-License-Identifier: Apache-2.0
"""Reading a ``LookupResponse`` (or a table's description) back into numpy arrays."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ibpembed_client._errors import LookupServiceError, code_from_int
from ibpembed_client._registered import RegisteredRegion
from ibpembed_client.v1 import lookup_pb2 as pb

try:  # optional: numpy's own dtype for bfloat16 values
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None
# numpy has no bfloat16: bf16 rows come back as their uint16 bit patterns (see bf16_to_float32).
DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_FLOAT16: ("float16", np.dtype("<f2")),
    pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2")),
    pb.DTYPE_UINT8: ("uint8", np.dtype("u1")),
    pb.DTYPE_INT8: ("int8", np.dtype("i1")),
    pb.DTYPE_INT32: ("int32", np.dtype("<i4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
}


@dataclass(frozen=True)
class LookupResult(Mapping[str, np.ndarray]):
    """One response, a read-only mapping feature -> array in request order:
    ``result["feature"]``, ``len(result)``, ``result.items()``, ``dict(result)``.

    ``[nnz, D]`` rows in the table dtype for pooling NONE (bfloat16 as uint16 bit patterns;
    ``dtypes`` says which), ``[B, D]`` float32 for SUM / MEAN. ``table_version`` is the table-set
    version that served it. In a stream, a request that failed gives a result with ``error`` set
    and no arrays; reading a feature of it raises that error.
    """

    request_id: str
    table_version: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    error: LookupServiceError | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        if self.error is not None:
            raise self.error
        return self.arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)


def pooled_bf16(request: pb.LookupRequest) -> np.dtype | None:
    """How a request's bfloat16 pooled values come back: ml_dtypes' dtype where installed."""
    return BFLOAT16 if request.output_dtype == pb.DTYPE_BFLOAT16 else None


def decode_response(
    response: pb.LookupResponse,
    region: RegisteredRegion | None = None,
    *,
    pooled_bf16: np.dtype | None = None,
) -> LookupResult:
    """Arrays from a response (``error`` set for a stream's failed request): copies of nothing,
    views of the response's bytes, or of ``region`` for a lookup that named an output region.
    ``pooled_bf16`` is the numpy dtype bfloat16 values come back as (default uint16 bits)."""
    if response.HasField("error"):
        error = LookupServiceError(
            code_from_int(response.error.code), response.error.message, response.request_id
        )
        return LookupResult(response.request_id, response.table_version, error=error)
    result = LookupResult(response.request_id, response.table_version)
    arrays, dtypes = result.arrays, result.dtypes
    for feature in response.features:
        name, dtype = DTYPES[feature.dtype]
        if pooled_bf16 is not None and feature.dtype == pb.DTYPE_BFLOAT16:
            dtype = pooled_bf16
        shape = feature.shape
        if region is None:
            flat = np.frombuffer(feature.values, dtype=dtype)
            # Two ints, not a tuple of the repeated field: per feature, that conversion cost
            # as much as the rest of the decoding.
            array = flat.reshape(shape[0], shape[1]) if len(shape) == 2 else flat.reshape(shape)
        else:
            array = region.memory.array(region.offset + feature.region_offset, dtype, tuple(shape))
        arrays[feature.name] = array
        dtypes[feature.name] = name
    return result


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact: bf16 is fp32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TableInfo:
    """A table as DescribeTable reports it (see lookup.proto for each field)."""

    name: str
    num_rows: int
    dim: int
    dtype: str
    quant: str
    raw_bytes: int
    stored_bytes: int
    chunk_bits: int
    version: int
    row_start: int
    row_end: int
    features: tuple[str, ...]

    @classmethod
    def from_proto(cls, info: pb.TableInfo) -> TableInfo:
        return cls(
            name=info.name,
            num_rows=info.num_rows,
            dim=info.dim,
            dtype=DTYPES[info.dtype][0] if info.dtype in DTYPES else "unspecified",
            quant=info.quant,
            raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes,
            chunk_bits=info.chunk_bits,
            version=info.version,
            row_start=info.row_start,
            row_end=info.row_end,
            features=tuple(info.features),
        )
