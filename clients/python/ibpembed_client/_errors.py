# SPDX-License-Identifier: Apache-2.0
"""The client's error type and the trailing metadata it reads its details from."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

# Trailing metadata the server adds to a RESOURCE_EXHAUSTED that means "over the admission limit,
# retry later", as opposed to one for an oversize message, which gRPC itself raises and no retry
# can fix.
OVERLOADED_METADATA_KEY = "ibpembed-overloaded"
# Trailing metadata of a FAILED_PRECONDITION for a pinned table-set version the server does not
# hold: the versions it holds, oldest first, comma-separated ("3,4").
VERSIONS_HELD_METADATA_KEY = "ibpembed-versions-held"


class LookupServiceError(Exception):
    """A failed RPC (or, in a stream, a failed request).

    Attributes
    ----------
    code : the gRPC status code.
    details : the server's message (names the bad field for INVALID_ARGUMENT).
    request_id : the request's id as the server logged it (one the client picked when the
        caller gave none); for a failed stream, the stream's id.
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


def code_from_int(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
