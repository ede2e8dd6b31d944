# SPDX-License-Identifier: Apache-2.0
"""Service errors and the one map from exceptions to gRPC status codes.

The engine and the servicer raise these; :mod:`ibpembed.server.interceptors` turns them into
statuses (unary RPCs) and the stream servicer into per-request ``Error`` messages, both through
:func:`status_for`, so a code never depends on which RPC carried the request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class ServiceError(Exception):
    """Base of the errors a client can cause or see; ``code`` is the gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """A malformed request. ``field`` names it the way the proto does (``features[2].ids``)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    """An unknown feature or table."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServiceError):
    """The server is at its in-flight limit; the client should back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Not ready yet, or draining for shutdown."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its work started."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


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
        code, message = exc.code, str(exc)
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
        request.request_id = request_id  # type: ignore[attr-defined]
    return request_id
