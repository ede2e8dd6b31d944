# SPDX-License-Identifier: Apache-2.0
"""Pieces shared by the sync and asyncio clients: request building, result decoding, options."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

import grpc
import numpy as np

from ibpembed_client.regions import OutputRegion, SharedMemoryRegion
from ibpembed_client.v1 import lookup_pb2 as pb

try:  # optional: numpy's own dtype for bfloat16 values
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None

Pooling = Literal["sum", "mean", "none"]
OutputDType = Literal["float32", "float16", "bfloat16"]
OUTPUT_DTYPES: dict[str, int] = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
}
POOLING: dict[str, int] = {"sum": pb.POOLING_SUM, "mean": pb.POOLING_MEAN, "none": pb.POOLING_NONE}
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
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Trailing metadata the server adds to a RESOURCE_EXHAUSTED that means "over the admission limit,
# retry later", as opposed to one for an oversize message, which gRPC itself raises and no retry
# can fix.
OVERLOADED_METADATA_KEY = "ibpembed-overloaded"
# Trailing metadata of a FAILED_PRECONDITION for a pinned table-set version the server does not
# hold: the versions it holds, oldest first, comma-separated ("3,4").
VERSIONS_HELD_METADATA_KEY = "ibpembed-versions-held"

# A routing hook: picks the server ("host:port") for a whole lookup request (e.g. by table, or
# one of several replicas); None sends everything to the client's target. Tables sharded by row
# range need each request split across servers: ibpembed_client.shards does that.
Router = Callable[[pb.LookupRequest], str]


class LookupServiceError(Exception):
    """A failed RPC (or, in a stream, a failed request).

    Attributes
    ----------
    code : the gRPC status code.
    details : the server's message (names the bad field for INVALID_ARGUMENT).
    request_id : the request's id, when known.
    attempts : tries made by this client's own retries (overload refusals: see
        :class:`RetryPolicy`; gRPC's retries of UNAVAILABLE happen below and are not counted).
    versions_held : for FAILED_PRECONDITION on a pinned table-set version, the versions the
        server holds (from its trailing metadata); None otherwise.
    shard : for the sharded clients, the shard that failed; None otherwise.
    """

    def __init__(
        self, code: grpc.StatusCode, details: str, request_id: str = "", attempts: int = 1
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.request_id = request_id
        self.attempts = attempts
        self.versions_held: tuple[int, ...] | None = None
        self.shard: int | None = None

    @classmethod
    def from_rpc_error(
        cls, err: grpc.RpcError, request_id: str = "", attempts: int = 1
    ) -> LookupServiceError:
        error = cls(err.code(), err.details() or "", request_id, attempts)
        error.versions_held = versions_held_in(err.trailing_metadata() or ())
        return error


def versions_held_in(metadata: Sequence[tuple[str, str | bytes]]) -> tuple[int, ...] | None:
    """The versions a server says it holds (:data:`VERSIONS_HELD_METADATA_KEY`), or None."""
    for key, value in metadata:
        if key == VERSIONS_HELD_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            try:
                return tuple(int(v) for v in text.split(",") if v)
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class FeatureBatch:
    """One feature's jagged ids for B samples (one key of a KeyedJaggedTensor).

    Parameters
    ----------
    ids : [nnz] int64 row ids, samples back to back.
    lengths : [B] int32 ids per sample.
    weights : optional [nnz] float32 per-id weights.
    """

    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def from_lists(
        cls,
        samples: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]] | None = None,
    ) -> FeatureBatch:
        """From per-sample id lists: ``[[3, 1], [], [7]]`` is B=3 with lengths ``[2, 0, 1]``.

        ``weights``, when given, holds one list per sample with one weight per id.

        Raises
        ------
        ValueError
            when ``weights`` does not match ``samples`` sample by sample.
        """
        lengths = np.array([len(s) for s in samples], dtype=np.int32)
        nnz = int(lengths.sum())
        ids = np.fromiter((i for s in samples for i in s), dtype=np.int64, count=nnz)
        w = None
        if weights is not None:
            # Flattened, a weight list that is short in one sample and long in another would
            # still match the total and silently weight the wrong ids.
            if len(weights) != len(samples):
                raise ValueError(f"{len(weights)} weight lists for {len(samples)} samples")
            for i, (s, ws) in enumerate(zip(samples, weights, strict=True)):
                if len(ws) != len(s):
                    raise ValueError(f"sample {i} has {len(s)} ids but {len(ws)} weights")
            w = np.fromiter((x for s in weights for x in s), dtype=np.float32, count=nnz)
        return cls(ids, lengths, w)


FeatureInput = Union[FeatureBatch, Sequence[Sequence[int]]]  # noqa: UP007 (runtime alias on 3.10)


def _le_bytes(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _int_bytes(array: np.ndarray, dtype: str, what: str) -> bytes:
    """``array`` as little-endian ``dtype`` bytes, refusing values a cast would change."""
    array = np.asarray(array)
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.dtype == dtype:  # already the wire's type: nothing a cast could change
        return array.tobytes()
    # A cast would truncate 1.9 to 1 and look up the wrong row; an empty list is float64 in
    # numpy but holds nothing to truncate.
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {array.dtype}")
    # ... and a narrowing cast would wrap 2**40 to 0 (lengths are int32 on the wire).
    limits = np.iinfo(np.dtype(dtype))
    if array.size and (int(array.min()) < limits.min or int(array.max()) > limits.max):
        raise ValueError(
            f"{what} must fit {np.dtype(dtype).name}, got values in "
            f"[{int(array.min())}, {int(array.max())}]"
        )
    return _le_bytes(array, dtype)


def build_request(
    features: Mapping[str, FeatureInput],
    pooling: Pooling = "sum",
    request_id: str = "",
    table_version: int = 0,
    *,
    output_dtype: OutputDType | None = None,
    output_region: OutputRegion | str | None = None,
) -> pb.LookupRequest:
    """A ``LookupRequest`` from per-feature batches or per-sample id lists.

    Parameters
    ----------
    features : feature name -> :class:`FeatureBatch` or list of per-sample id lists.
    pooling : ``"sum"``, ``"mean"`` or ``"none"`` (rows, bit-exact).
    request_id : echoed back and logged by the server on failures; empty = server picks one.
    table_version : the table-set version to be served from (FAILED_PRECONDITION when the
        server does not hold it); 0 = the newest it holds.
    output_dtype : ``"float32"``, ``"float16"`` or ``"bfloat16"`` pooled outputs (the server
        rounds its fp32 sums once, to nearest even); None = float32. Not with ``"none"``.
    output_region : a registered region (its name, or an :class:`OutputRegion` window of it)
        for the server to write the values into instead of the response.

    Raises
    ------
    TypeError
        for ids or lengths that are not integers.
    ValueError
        for ids or lengths that are not 1-D, or an unknown pooling.
    """
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {sorted(POOLING)}, got {pooling!r}")
    request = pb.LookupRequest(
        request_id=request_id, pooling=POOLING[pooling], table_version=table_version
    )
    if output_dtype is not None:
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype must be one of {sorted(OUTPUT_DTYPES)}, got {output_dtype!r}"
            )
        request.output_dtype = OUTPUT_DTYPES[output_dtype]
    if output_region is not None:
        window = OutputRegion(output_region) if isinstance(output_region, str) else output_region
        request.output_region.name = window.name
        request.output_region.offset = window.offset
        request.output_region.byte_size = window.byte_size
    add = request.features.add  # in place: append() would copy each message
    for name, value in features.items():
        batch = value if isinstance(value, FeatureBatch) else FeatureBatch.from_lists(value)
        add(
            name=name,
            ids=_int_bytes(batch.ids, "<i8", f"feature {name!r}: ids"),
            lengths=_int_bytes(batch.lengths, "<i4", f"feature {name!r}: lengths"),
            weights=b"" if batch.weights is None else _le_bytes(batch.weights, "<f4"),
        )
    return request


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


def pooled_bf16(request: pb.LookupRequest) -> np.dtype | None:
    """How a request's bfloat16 pooled values come back: ml_dtypes' dtype where installed."""
    return BFLOAT16 if request.output_dtype == pb.DTYPE_BFLOAT16 else None


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
            _code_from_int(response.error.code), response.error.message, response.request_id
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


def _code_from_int(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


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


@dataclass(frozen=True)
class RetryPolicy:
    """Retries with exponential backoff and full jitter, on calls that never ran, within a
    client-wide retry budget.

    Retried: UNAVAILABLE (server starting, draining, connection lost, a replica gone) and, with
    ``retry_overloaded``, a RESOURCE_EXHAUSTED the server marks as overload (its admission
    limit: the request was refused before any work). Other codes are answers, and an oversize
    message stays one however often it is sent. Retries stay inside the call's overall timeout.

    UNAVAILABLE is retried by gRPC itself, from the service config :meth:`service_config` builds
    (retryPolicy and retryThrottling, gRFC A6): transparent, per attempt on a fresh pick of the
    load-balancing policy (another replica with ``round_robin``), and the same JSON configures a
    Go, Java or C++ frontend (``proto/ibpembed/v1/service_config.json`` is the default
    policy's).
    gRPC cannot tell an overload refusal from its own oversize-message RESOURCE_EXHAUSTED (only
    the server's trailer does), so those retries stay here, under the same parameters.

    The budget is gRPC's retry throttling: a client holds ``budget_tokens`` tokens; a try that
    fails with a retryable code takes one, a call that succeeds gives back
    ``budget_token_ratio``, and retries pause while half or fewer are left. Under sustained
    overload a client then stops multiplying its load (at most ``max_attempts`` times it) and
    goes back to one try per call until calls succeed again. gRPC caps ``max_attempts`` at 5
    and takes whole tokens.

    Parameters
    ----------
    max_attempts : total tries including the first (1 = no retry).
    initial_backoff_s, max_backoff_s, multiplier : backoff before try k is
        ``uniform(0, min(max_backoff_s, initial_backoff_s * multiplier**(k-1)))`` seconds.
    retry_overloaded : also retry the server's overload refusals.
    budget_tokens, budget_token_ratio : the retry budget; ``budget_tokens=None`` = no budget.
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    retry_overloaded: bool = True
    budget_tokens: float | None = 10.0
    budget_token_ratio: float = 0.1

    def backoff(self, attempt: int) -> float:
        """Sleep before retry number ``attempt`` (1-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return random.uniform(0.0, cap)

    def service_config(self, service: str = "ibpembed.v1.EmbeddingLookup") -> dict:
        """The gRPC service config retrying UNAVAILABLE under this policy (``grpc.service_config``
        channel option; JSON for any gRPC language)."""
        config: dict = {}
        if self.max_attempts > 1:
            config["methodConfig"] = [
                {
                    "name": [{"service": service}],
                    "retryPolicy": {
                        "maxAttempts": self.max_attempts,
                        # grpcio 1.85 held a retry until the deadline with "0.001s"
                        # (measured; 2 ms and more worked): 10 ms at least.
                        "initialBackoff": f"{max(self.initial_backoff_s, 0.01):g}s",
                        "maxBackoff": f"{self.max_backoff_s:g}s",
                        "backoffMultiplier": self.multiplier,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
            if self.budget_tokens is not None:
                config["retryThrottling"] = {
                    # gRPC takes a whole number of tokens, 1 to 1000.
                    "maxTokens": max(1, min(1000, round(self.budget_tokens))),
                    "tokenRatio": self.budget_token_ratio,
                }
        return config

    def retryable(self, err: grpc.RpcError) -> bool:
        """Whether ``err`` is a failure this policy retries in Python: the server's overload
        refusals (gRPC's own retries handle UNAVAILABLE, see :meth:`service_config`)."""
        code = err.code()
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED or not self.retry_overloaded:
            return False
        trailing = err.trailing_metadata() or ()
        return any(key == OVERLOADED_METADATA_KEY for key, _ in trailing)


class Retrier:
    """A client's retry decisions: its :class:`RetryPolicy` and the budget it spends.
    Thread-safe (the sync client's threads share one)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._tokens = policy.budget_tokens

    def succeeded(self) -> None:
        """A call succeeded (OK; as in gRPC, other final codes give nothing back)."""
        # Read without the lock first: the budget is full for almost every call of a healthy
        # client, and this runs after each of them.
        if self._tokens is None or self._tokens >= self.policy.budget_tokens:
            return
        with self._lock:
            self._tokens = min(
                self.policy.budget_tokens, self._tokens + self.policy.budget_token_ratio
            )

    def pause_before_retry(
        self, err: grpc.RpcError, attempt: int, deadline: float | None
    ) -> float | None:
        """Seconds to wait before retrying after try ``attempt`` failed with ``err``, or None to
        give up (not retryable, out of tries, out of budget, or past the deadline)."""
        if not self.policy.retryable(err):
            return None
        within_budget = True
        if self._tokens is not None:
            with self._lock:
                self._tokens = max(0.0, self._tokens - 1.0)
                within_budget = self._tokens > self.policy.budget_tokens / 2
        if not within_budget or attempt >= self.policy.max_attempts:
            return None
        pause = self.policy.backoff(attempt)
        if deadline is not None and time.monotonic() + pause >= deadline:
            return None
        return pause


@dataclass(frozen=True)
class KeepAliveOptions:
    """HTTP/2 keepalive pings, so idle connections through load balancers stay open.

    Parameters
    ----------
    time_ms : ping after this many ms without activity (server accepts >= 10000).
    timeout_ms : close the connection if a ping is not answered in this many ms.
    permit_without_calls : ping even with no RPC in flight.
    """

    time_ms: int = 30_000
    timeout_ms: int = 10_000
    permit_without_calls: bool = True


ChannelOptions = Sequence[tuple[str, Union[str, int]]]  # noqa: UP007 (runtime alias on 3.10)


def channel_options(
    max_message_bytes: int,
    keepalive: KeepAliveOptions | None,
    retry: RetryPolicy | None = None,
    extra: ChannelOptions = (),
) -> list[tuple[str, str | int]]:
    """The client's gRPC channel arguments: message limits, keepalive, the retry service config,
    then ``extra`` (e.g. ``("grpc.lb_policy_name", "round_robin")``), which override the rest."""
    options: list[tuple[str, str | int]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if retry is not None:
        options += [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(retry.service_config())),
        ]
    if keepalive is not None:
        options += [
            ("grpc.keepalive_time_ms", keepalive.time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(keepalive.permit_without_calls)),
        ]
    overridden = {key for key, _ in extra}
    return [(k, v) for k, v in options if k not in overridden] + list(extra)


@dataclass(frozen=True)
class TlsOptions:
    """TLS for the channel; add ``private_key`` and ``certificate_chain`` for mTLS (PEM bytes)."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    # Expected server name, when the certificate's name differs from the target host.
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )

    def options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def call_metadata(token: str | None, request_id: str = "") -> tuple[tuple[str, str], ...]:
    """Per-call metadata: the bearer token and, for streams, an id for the server's log."""
    metadata: list[tuple[str, str]] = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if request_id:
        metadata.append(("x-request-id", request_id))
    return tuple(metadata)
