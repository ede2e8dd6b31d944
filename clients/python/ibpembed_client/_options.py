# SPDX-License-Identifier: Apache-2.0
"""How a client connects and retries: channel arguments, keepalive, TLS, retry policy."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import grpc

from ibpembed_client._errors import OVERLOADED_METADATA_KEY

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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
        budget = self.policy.budget_tokens
        if self._tokens is None or budget is None or self._tokens >= budget:
            return
        with self._lock:
            self._tokens = min(budget, self._tokens + self.policy.budget_token_ratio)

    def pause_before_retry(
        self, err: grpc.RpcError, attempt: int, deadline: float | None
    ) -> float | None:
        """Seconds to wait before retrying after try ``attempt`` failed with ``err``, or None to
        give up (not retryable, out of tries, out of budget, or past the deadline)."""
        if not self.policy.retryable(err):
            return None
        within_budget = True
        budget = self.policy.budget_tokens
        if self._tokens is not None and budget is not None:
            with self._lock:
                self._tokens = max(0.0, self._tokens - 1.0)
                within_budget = self._tokens > budget / 2
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


@dataclass(frozen=True)
class OutlierEjection:
    """Route around a replica that keeps failing calls: gRPC's outlier detection (gRFC A50)
    over the load-balancing policy, in the service config.

    A hung replica (SIGSTOPped, wedged, on a half-dead node) keeps its connections and takes
    calls but answers none: each of its calls fails at its deadline, which no retry can fix (the
    deadline is spent), and ``round_robin`` keeps sending it its share. Every ``interval_s``
    gRPC counts each address's calls; an address that failed ``failure_percent`` % or more of
    at least ``request_volume`` calls, while ``minimum_hosts`` addresses had that many, is
    ejected from the policy for ``base_ejection_s`` (times its ejections in a row, at most
    ``max_ejection_s``), never more than ``max_ejection_percent`` % of the addresses at once.
    A hung replica fails calls only where they have a deadline (the client's ``timeout``). One
    address alone is never ejected. Every non-OK status counts as a failure: a caller sending
    only invalid requests to two replicas gets one ejected for a while (the other still serves).
    """

    interval_s: float = 1.0
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: int = 50
    failure_percent: int = 50
    minimum_hosts: int = 2
    request_volume: int = 2

    def lb_config(self, child: str = "round_robin") -> dict:
        """The ``loadBalancingConfig`` entry: this ejection over policy ``child``."""
        return {
            "outlier_detection_experimental": {
                "interval": f"{self.interval_s:g}s",
                "baseEjectionTime": f"{self.base_ejection_s:g}s",
                "maxEjectionTime": f"{self.max_ejection_s:g}s",
                "maxEjectionPercent": self.max_ejection_percent,
                "failurePercentageEjection": {
                    "threshold": self.failure_percent,
                    "enforcementPercentage": 100,
                    "minimumHosts": self.minimum_hosts,
                    "requestVolume": self.request_volume,
                },
                "childPolicy": [{child: {}}],
            }
        }


# On by default: a replicated target routes around a hung replica without configuration.
DEFAULT_OUTLIER_EJECTION = OutlierEjection()


def service_config(
    retry: RetryPolicy | None,
    outlier: OutlierEjection | None,
    lb_policy: str = "round_robin",
) -> dict:
    """The gRPC service config of a client (JSON for any gRPC language): ``retry``'s retries of
    UNAVAILABLE and ``outlier``'s ejection over ``lb_policy``.
    ``proto/ibpembed/v1/service_config.json`` is the default client's."""
    config = retry.service_config() if retry is not None else {}
    if outlier is not None:
        config["loadBalancingConfig"] = [outlier.lb_config(lb_policy)]
    return config


def channel_options(
    max_message_bytes: int,
    keepalive: KeepAliveOptions | None,
    retry: RetryPolicy | None = None,
    extra: ChannelOptions = (),
    outlier: OutlierEjection | None = None,
) -> list[tuple[str, str | int]]:
    """The client's gRPC channel arguments: message limits, keepalive, the service config
    (retries, outlier ejection), then ``extra`` (e.g. ``("grpc.lb_policy_name",
    "round_robin")``), which override the rest; with ``outlier``, a ``grpc.lb_policy_name`` in
    ``extra`` becomes the policy under the ejection (as a channel argument it would replace the
    service config's balancing, the ejection with it)."""
    options: list[tuple[str, str | int]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    lb_policy = "round_robin"
    if outlier is not None:
        for key, value in extra:
            if key == "grpc.lb_policy_name":
                lb_policy = str(value)
        extra = [(k, v) for k, v in extra if k != "grpc.lb_policy_name"]
    config = service_config(retry, outlier, lb_policy)
    if retry is not None:
        options.append(("grpc.enable_retries", 1))
    if config:
        options.append(("grpc.service_config", json.dumps(config)))
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
