# SPDX-License-Identifier: Apache-2.0
"""Why a port cannot be listened on, in one wording for the gRPC port and the metrics port."""

from __future__ import annotations

import errno
import socket

IN_USE = "the port is in use (by another server: another `ibpembed serve`?)"


def bind_error_text(exc: OSError) -> str:
    """``exc`` (a failed bind) in words, without the ``[Errno N]`` ``str(OSError)`` starts with."""
    if exc.errno == errno.EADDRINUSE:
        return IN_USE
    return exc.strerror or str(exc)


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, as the OS says it; None when it can."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            probe.bind(address)
    except OSError as exc:
        return bind_error_text(exc)
    return None
