# SPDX-License-Identifier: Apache-2.0
"""Errors the engine and the table store raise for what a client caused or can see.

Transport-neutral on purpose: nothing here knows gRPC. Each transport maps these classes to its
own codes (:func:`ibpembed.server.status.status_for` for gRPC), so a second front end (REST, an
in-process batcher) inherits the errors without inheriting grpc.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors a client can cause or see; anything else is a server bug."""


class InvalidArgument(ServiceError):
    """A malformed request. ``field`` names it the way the proto does (``features[2].ids``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    """An unknown feature or table."""


class AlreadyExists(ServiceError):
    """The named resource exists already (a shared-memory region registered twice)."""


class FailedPrecondition(ServiceError):
    """The request is well formed but the server's state cannot serve it (e.g. a version)."""


class VersionNotHeld(FailedPrecondition):
    """A request pinned to a table-set version the server does not hold (any more, or yet).

    ``held`` lists the versions it does hold, oldest first; transports pass them on in a form a
    client can read without parsing the message (gRPC: trailing metadata).
    """

    def __init__(self, version: int, held: tuple[int, ...]) -> None:
        super().__init__(
            f"table set version {version} is not held here; versions held: "
            + ", ".join(str(v) for v in held)
        )
        self.version = version
        self.held = held


class PermissionDenied(ServiceError):
    """The caller may not use the named resource (another caller's region)."""


class Overloaded(ServiceError):
    """The server is at its in-flight limit; the client should back off and retry."""


class ResourceExhausted(ServiceError):
    """A per-caller quota is used up (not overload: retrying does not help until the caller
    frees some)."""


class Unavailable(ServiceError):
    """Not ready yet, or draining for shutdown."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its work started."""


class Unimplemented(ServiceError):
    """A feature this build or host does not offer (the message says why)."""
