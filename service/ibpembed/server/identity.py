# SPDX-License-Identifier: Apache-2.0
"""Who a caller is: the identity its bearer token names, or one shared anonymous identity.

Identity decides who may use and release a shared-memory region and whose quota a region counts
against. It comes only from tokens the operator configured: ``--auth-token-file`` (one token,
identity ``token``) and ``--auth-tokens-file`` (one ``<identity> <token>`` a line, so each
frontend gets its own identity and its own regions). A server without tokens cannot tell
callers apart, so every caller is ``anonymous``: an ``authorization`` header it was never told
to check names nobody, or a client could make up a new identity per call and with it a fresh
quota.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

from ibpembed.errors import PermissionDenied

ANONYMOUS = "anonymous"
# The identity of the one token of ``--auth-token-file``.
SINGLE_TOKEN_IDENTITY = "token"


def read_tokens(token_file: str | None, tokens_file: str | None) -> dict[str, str]:
    """Token -> identity from the two settings' files (empty: no auth).

    Raises ValueError naming the file and line (never the token) for a malformed line, an
    identity or a token given twice.
    """
    tokens: dict[str, str] = {}
    entries: list[tuple[str, int, str, str]] = []
    if token_file is not None:
        entries.append((token_file, 1, SINGLE_TOKEN_IDENTITY, _read(token_file).strip()))
    if tokens_file is not None:
        for number, line in enumerate(_read(tokens_file).splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(
                    f"{tokens_file}:{number}: expected '<identity> <token>' ({len(fields)} fields)"
                )
            entries.append((tokens_file, number, fields[0], fields[1]))
    identities: set[str] = set()
    for path, number, identity, token in entries:
        if not token:
            raise ValueError(f"{path}:{number}: empty bearer token")
        if identity == ANONYMOUS:
            raise ValueError(f"{path}:{number}: {ANONYMOUS!r} is reserved for callers without auth")
        if identity in identities:
            raise ValueError(f"{path}:{number}: identity {identity!r} given twice")
        if token in tokens:
            raise ValueError(f"{path}:{number}: this token is already given to {tokens[token]!r}")
        identities.add(identity)
        tokens[token] = identity
    return tokens


def _read(path: str) -> str:
    return Path(path).read_text()


class CallerIdentities:
    """Maps a call's metadata to its caller's identity.

    ``tokens``: token -> identity; empty means the server has no auth and every caller is
    :data:`ANONYMOUS`.
    """

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        self._by_header = {f"Bearer {t}".encode(): i for t, i in (tokens or {}).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._by_header)

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The identity of the call's token; None without a configured one. Every configured
        token is compared in constant time, so response timing tells nothing about them."""
        header = _authorization(metadata)
        if header is None:
            return None
        found = None
        for expected, identity in self._by_header.items():
            if hmac.compare_digest(header, expected):
                found = identity
        return found

    def of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's identity: its token's (the auth interceptor let only configured tokens
        through), or :data:`ANONYMOUS` on a server without tokens."""
        if not self._by_header:
            return ANONYMOUS
        header = _authorization(metadata)
        identity = self._by_header.get(header) if header is not None else None
        if identity is None:  # unreachable behind the auth interceptor; never a free identity
            raise PermissionDenied("call without a configured bearer token")
        return identity


def _authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else value
    return None
