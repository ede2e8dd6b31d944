# SPDX-License-Identifier: Apache-2.0
"""The one map from :mod:`ibpembed.errors` to gRPC status codes, and request-id plumbing.

The engine and the servicer raise the transport-neutral errors; :mod:`ibpembed.server.interceptors`
turns them into statuses (unary RPCs) and the stream servicer into per-request ``Error``
messages, both through :func:`status_for`, so a code never depends on which RPC carried it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ibpembed.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Overloaded,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    Unimplemented,
)

STATUS_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
}


def code_for(exc: ServiceError) -> grpc.StatusCode:
    """The status of a service error (its nearest mapped base class; INTERNAL if none)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


class UndecodableRequest:
    """Stands in for a request message whose bytes do not parse.

    grpc answers a deserializer exception with UNKNOWN (INTERNAL on streams) and logs a
    traceback per message, so a client sending garbage could flood the log. The servicer side
    turns this placeholder into INVALID_ARGUMENT instead (per message on LookupStream).
    """

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.request_id = ""

    def error(self) -> InvalidArgument:
        return InvalidArgument("request", f"not a valid protobuf message: {self.problem}")


def tolerant_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``deserialize``, returning :class:`UndecodableRequest` instead of raising DecodeError."""

    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except DecodeError as exc:
            return UndecodableRequest(str(exc))

    return parse


# Messages echo request fields (feature and table names). The status message travels in the
# trailers, which clients cap at 8 KiB by default (percent-encoded: up to 6 bytes a character):
# past that the client sees RESOURCE_EXHAUSTED instead of the real code.
MAX_MESSAGE_CHARS = 512
# Longest request id a client may choose (a UUID is 36; trace ids are 32-64).
MAX_REQUEST_ID_CHARS = 256


def status_for(exc: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for ``exc``.

    Anything that is not a :class:`ServiceError` is a server bug: the client gets INTERNAL with
    the request id (to find the logged traceback) and none of the exception's text.
    """
    if isinstance(exc, ServiceError):
        code, message = code_for(exc), str(exc)
    else:
        code, message = grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "... (truncated)"
    return code, message


def ensure_request_id(request: object) -> str:
    """The request's ``request_id``, set to a fresh one first when the client left it empty."""
    request_id = getattr(request, "request_id", "")
    if not request_id and hasattr(request, "request_id"):
        request_id = uuid.uuid4().hex
        request.request_id = request_id
    return request_id
