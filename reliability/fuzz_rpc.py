# SPDX-License-Identifier: Apache-2.0
"""RPC fuzz: hostile traffic against a real ``ibpembed serve`` process.

    python -m reliability.fuzz_rpc --cases 20000 [--seed 0] [--concurrency 16] [--json PATH]

Each case is one call (or one stream) drawn from a category: random bytes as a request,
mutated (bit-flipped, truncated) valid requests, valid requests with random field values (the
rows of pooling NONE are checked bit for bit against the source tables), ids past the table or
negative, negative / huge / inconsistent lengths, byte counts that are not whole values,
mismatched weights, unknown and empty feature names, unknown pooling values, empty batches,
requests and responses over the message limit, calls cancelled mid-flight, deadlines that expire
before or during the work, streams (half-closed, cancelled, abandoned, carrying bad messages),
table listing and description, and methods that do not exist.

Every category has the set of status codes it may end with (``ALLOWED``); anything else is a
finding. The server runs as its own process: it must stay alive, log no traceback, and keep its
RSS and open file descriptors flat (sampled every ``--check-every`` cases after a warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ibpembed_client.v1 import lookup_pb2 as pb
from reliability.common import FuzzTable, fuzz_tables, pack_fuzz_set, settle
from tools.serve_process import ServerProcess

C = grpc.StatusCode
SERVICE = "/ibpembed.v1.EmbeddingLookup/"
MAX_MESSAGE_MB = 4
MAX_INFLIGHT = 64
# Lookups may always meet the in-flight limit (RESOURCE_EXHAUSTED is overload by design; any
# other RESOURCE_EXHAUSTED, e.g. a client-side size limit, is a finding).
OVERLOAD = "server at capacity"
# Per case (each case runs in its own task, hence its own context): such RESOURCE_EXHAUSTEDs.
_EXHAUSTED: contextvars.ContextVar[list[str]] = contextvars.ContextVar("exhausted")
_LOOKUP = {C.RESOURCE_EXHAUSTED}
# Random bytes can decode into a request that pins a table-set version the server does not
# hold: FAILED_PRECONDITION is then the right answer.
_ANY_REQUEST = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION}
ALLOWED: dict[str, set[C]] = {
    "garbage": _ANY_REQUEST | _LOOKUP,
    "mutated": _ANY_REQUEST | _LOOKUP,
    "valid": {C.OK} | _LOOKUP,
    "empty": {C.OK} | _LOOKUP,
    "bad_ids": {C.INVALID_ARGUMENT} | _LOOKUP,
    "bad_lengths": {C.INVALID_ARGUMENT} | _LOOKUP,
    "bad_bytes": {C.INVALID_ARGUMENT} | _LOOKUP,
    "bad_weights": {C.INVALID_ARGUMENT} | _LOOKUP,
    "unknown_feature": {C.NOT_FOUND} | _LOOKUP,
    "bad_name": {C.INVALID_ARGUMENT} | _LOOKUP,
    "bad_pooling": {C.INVALID_ARGUMENT} | _LOOKUP,
    "oversize_request": {C.RESOURCE_EXHAUSTED},
    "oversize_response": {C.INVALID_ARGUMENT} | _LOOKUP,
    "deadline": {C.OK, C.DEADLINE_EXCEEDED} | _LOOKUP,
    "cancelled": {C.OK, C.CANCELLED} | _LOOKUP,
    "stream": {C.OK},
    "stream_garbage": {C.OK},
    "stream_cancelled": {C.OK, C.CANCELLED},
    "stream_abandoned": {C.CANCELLED},
    "list_tables": {C.OK, C.INVALID_ARGUMENT},
    "describe_table": {C.OK, C.NOT_FOUND, C.INVALID_ARGUMENT},
    "unknown_method": {C.UNIMPLEMENTED},
    "probe_garbage": {C.OK, C.INVALID_ARGUMENT},
}
# Categories a stream message can be drawn from, and what its per-message error may be.
STREAM_MESSAGES = ("valid", "empty", "bad_ids", "bad_lengths", "bad_bytes", "bad_weights",
                   "unknown_feature", "bad_name", "bad_pooling")  # fmt: skip
# Relative frequency of each category.
WEIGHTS: dict[str, float] = {
    "garbage": 8, "mutated": 8, "valid": 10, "empty": 2, "bad_ids": 6, "bad_lengths": 6,
    "bad_bytes": 5, "bad_weights": 5, "unknown_feature": 3, "bad_name": 3, "bad_pooling": 3,
    "oversize_request": 0.3, "oversize_response": 0.5, "deadline": 6, "cancelled": 6,
    "stream": 4, "stream_garbage": 1, "stream_cancelled": 2, "stream_abandoned": 1,
    "list_tables": 1, "describe_table": 2, "unknown_method": 1, "probe_garbage": 1,
}  # fmt: skip


@dataclass
class Findings:
    """Outcome counts and anything outside the contract."""

    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)  # (category, code) -> count
    unexpected: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # (cases, rss, fds) over the run

    def add(self, category: str, code: C, detail: str = "") -> None:
        self.outcomes[(category, code.name)] += 1
        if code not in ALLOWED[category] or detail:
            if len(self.unexpected) < 50:
                self.unexpected.append({"category": category, "code": code.name, "detail": detail})
            else:
                self.unexpected.append({"category": category, "code": code.name})


# -- requests ------------------------------------------------------------------------------------
class Requests:
    """Random requests over the fuzz tables; ``valid`` ones carry the rows they must return."""

    def __init__(self, tables: Sequence[FuzzTable], rng: np.random.Generator) -> None:
        self.rng = rng
        self.features = {f: t for t in tables for f in t.features}
        self.names = sorted(self.features)

    def feature(self, name: str, pooling: int) -> tuple[pb.FeatureInput, np.ndarray]:
        rng, table = self.rng, self.features[name]
        rows = table.weight.shape[0]
        lengths = rng.integers(0, 6, int(rng.integers(0, 9))).astype("<i4")
        ids = rng.integers(0, rows, int(lengths.sum())).astype("<i8")
        if ids.size and rng.random() < 0.3:
            ids[rng.integers(ids.size)] = rng.choice([0, rows - 1])
        weights = b""
        if pooling != pb.POOLING_NONE and rng.random() < 0.4:
            weights = rng.normal(0, 1, ids.size).astype("<f4").tobytes()
        fi = pb.FeatureInput(
            name=name, ids=ids.tobytes(), lengths=lengths.tobytes(), weights=weights
        )
        return fi, ids

    def valid(self) -> tuple[pb.LookupRequest, list[tuple[str, np.ndarray]]]:
        """A valid request and, per feature, the ids whose rows NONE must return."""
        rng = self.rng
        pooling = int(rng.choice([0, 1, 2, 3]))
        chosen = rng.choice(self.names, int(rng.integers(1, 4)), replace=False)
        request = pb.LookupRequest(request_id=f"fz-{rng.integers(1 << 30)}", pooling=pooling)
        expected = []
        for name in chosen:
            fi, ids = self.feature(str(name), pooling)
            request.features.append(fi)
            expected.append((str(name), ids))
        return request, expected

    def broken(self, category: str) -> pb.LookupRequest:
        """A request that must fail with the category's code."""
        rng = self.rng
        request, _ = self.valid()
        while category in ("bad_ids", "bad_lengths", "bad_weights") and not any(
            len(f.ids) for f in request.features
        ):
            request, _ = self.valid()
        f = request.features[int(rng.integers(len(request.features)))]
        if category in ("bad_ids", "bad_lengths", "bad_weights"):
            f = next(f for f in request.features if len(f.ids))
        if category == "empty":
            if rng.random() < 0.5:
                del request.features[:]
            else:
                for g in request.features:
                    g.ids, g.lengths, g.weights = b"", b"", b""
        elif category == "bad_ids":
            ids = np.frombuffer(f.ids, "<i8").copy()
            rows = self.features[f.name].weight.shape[0]
            bad = [-1, rows, rows + 1, 2**63 - 1, -(2**63), 2**40, -rows]
            ids[rng.integers(ids.size)] = rng.choice(bad)
            f.ids = ids.tobytes()
        elif category == "bad_lengths":
            lengths = np.frombuffer(f.lengths, "<i4").copy()
            i = rng.integers(lengths.size)
            choice = rng.integers(4)
            if choice == 0:  # negative count, total kept
                lengths[i] -= lengths[i] + 1
                lengths[(i + 1) % lengths.size] += lengths[i] if lengths.size == 1 else 0
            elif choice == 1:  # sum one too many or too few
                lengths[i] += rng.choice([-1, 1]) if lengths[i] else 1
            elif choice == 2:  # huge
                lengths[i] = rng.choice([2**31 - 1, -(2**31)])
            else:  # lengths with no sample but ids present
                lengths = lengths[:0]
            f.lengths = lengths.tobytes()
        elif category == "bad_bytes":
            which = rng.integers(3)
            if which == 0:
                f.ids = f.ids + bytes(int(rng.integers(1, 8)))
            elif which == 1:
                f.lengths = f.lengths + bytes(int(rng.integers(1, 4)))
            else:
                request.pooling = pb.POOLING_SUM
                f.weights = bytes(4 * (len(f.ids) // 8)) + bytes(int(rng.integers(1, 4)))
        elif category == "bad_weights":
            n = len(f.ids) // 8
            if rng.random() < 0.5:
                request.pooling = pb.POOLING_NONE
                f.weights = np.ones(n, "<f4").tobytes()
            else:
                request.pooling = pb.POOLING_SUM
                f.weights = np.ones(n + int(rng.choice([-1, 1, 7])), "<f4").tobytes()
                if n == 1 and not f.weights:
                    f.weights = np.ones(2, "<f4").tobytes()
        elif category == "unknown_feature":
            names = ["nope", "USER", "user ", "é" * 300, "x" * 10000, "\x00"]
            f.name = names[int(rng.integers(len(names)))]  # (numpy arrays drop a trailing NUL)
        elif category == "bad_name":
            if rng.random() < 0.5:
                f.name = ""
            else:
                request.features.append(pb.FeatureInput(name=f.name))
        elif category == "bad_pooling":
            request.pooling = int(rng.choice([4, 5, 99, 2**31 - 1, -1, -(2**31)]))
        return request

    def garbage(self) -> bytes:
        n = int(min(self.rng.geometric(1 / 64), 4096))
        return self.rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    def mutated(self) -> bytes:
        data = bytearray(self.valid()[0].SerializeToString())
        for _ in range(int(self.rng.integers(1, 4))):
            op = self.rng.integers(3)
            if not data:
                break
            i = int(self.rng.integers(len(data)))
            if op == 0:
                data[i] ^= 1 << int(self.rng.integers(8))
            elif op == 1:
                del data[i:]
            else:
                data.insert(i, int(self.rng.integers(256)))
        return bytes(data)


# -- calls ---------------------------------------------------------------------------------------
def _identity(x: bytes) -> bytes:
    return x


class Fuzzer:
    """Runs cases against one server over one channel."""

    def __init__(self, channel: grpc.aio.Channel, requests: Requests, findings: Findings) -> None:
        self.channel = channel
        self.req = requests
        self.rng = requests.rng
        self.findings = findings
        self.unary = {
            name: channel.unary_unary(SERVICE + name, _identity, _identity)
            for name in ("Lookup", "ListTables", "DescribeTable")
        }
        self.stream = channel.stream_stream(SERVICE + "LookupStream", _identity, _identity)

    async def call(self, method: str, body: bytes, timeout: float = 30.0) -> tuple[C, bytes]:
        """(code, reply bytes); RESOURCE_EXHAUSTED other than overload is noted as a finding."""
        try:
            reply = await self.unary[method](body, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            if err.code() == C.RESOURCE_EXHAUSTED and OVERLOAD not in details:
                _EXHAUSTED.get().append(details[:200])
            return err.code(), b""
        return C.OK, reply

    async def case(self, category: str) -> None:
        handler: Callable = getattr(self, f"_{category}", None) or self._broken
        _EXHAUSTED.set(notes := [])
        code, detail = await handler(category)
        if category != "oversize_request" and notes:
            detail = detail or f"RESOURCE_EXHAUSTED but not overload: {notes[-1]}"
        self.findings.add(category, code, detail)

    async def _garbage(self, category: str) -> tuple[C, str]:
        return (await self.call("Lookup", self.req.garbage()))[0], ""

    async def _mutated(self, category: str) -> tuple[C, str]:
        return (await self.call("Lookup", self.req.mutated()))[0], ""

    async def _valid(self, category: str) -> tuple[C, str]:
        request, expected = self.req.valid()
        code, reply = await self.call("Lookup", request.SerializeToString())
        detail = ""
        if code == C.OK:
            detail = check_response(
                request, expected, pb.LookupResponse.FromString(reply), self.req
            )
        return code, detail

    async def _broken(self, category: str) -> tuple[C, str]:
        return (await self.call("Lookup", self.req.broken(category).SerializeToString()))[0], ""

    async def _oversize_request(self, category: str) -> tuple[C, str]:
        size = MAX_MESSAGE_MB * 2**20 + int(self.rng.integers(1, 2**20))
        request = pb.LookupRequest(features=[pb.FeatureInput(name="user", ids=bytes(size))])
        return (await self.call("Lookup", request.SerializeToString()))[0], ""

    async def _oversize_response(self, category: str) -> tuple[C, str]:
        # 64-byte rows: this many ids return more than the message limit.
        n = MAX_MESSAGE_MB * 2**20 // 64 + int(self.rng.integers(1, 10_000))
        ids = self.rng.integers(0, 1000, n).astype("<i8")
        feature = pb.FeatureInput(
            name="user", ids=ids.tobytes(), lengths=np.array([n], "<i4").tobytes()
        )
        request = pb.LookupRequest(pooling=pb.POOLING_NONE, features=[feature])
        return (await self.call("Lookup", request.SerializeToString()))[0], ""

    async def _deadline(self, category: str) -> tuple[C, str]:
        request, _ = self.req.valid()
        timeout = float(10 ** self.rng.uniform(-5, -1.5))
        return (await self.call("Lookup", request.SerializeToString(), timeout=timeout))[0], ""

    async def _cancelled(self, category: str) -> tuple[C, str]:
        request, _ = self.req.valid()
        call = self.unary["Lookup"](request.SerializeToString(), timeout=30)
        await asyncio.sleep(float(self.rng.uniform(0, 0.005)))
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await call
        return await call.code(), ""

    def _stream_messages(self, k: int, garbage: bool) -> list[tuple[str, bytes]]:
        out = []
        for _ in range(k):
            kind = str(self.rng.choice(STREAM_MESSAGES))
            if kind == "valid":
                body = self.req.valid()[0].SerializeToString()
            else:
                body = self.req.broken(kind).SerializeToString()
            out.append((kind, body))
        if garbage:
            out.insert(int(self.rng.integers(len(out) + 1)), ("garbage", self.req.garbage()))
        return out

    async def _stream(self, category: str) -> tuple[C, str]:
        messages = self._stream_messages(
            int(self.rng.integers(0, 12)), category == "stream_garbage"
        )
        call = self.stream(iter(body for _, body in messages), timeout=30)
        replies = []
        try:
            async for reply in call:
                replies.append(pb.LookupResponse.FromString(reply))
        except grpc.aio.AioRpcError as err:
            return err.code(), ""
        if len(replies) != len(messages):
            return C.OK, f"{len(messages)} requests, {len(replies)} responses"
        for (kind, _), reply in zip(messages, replies, strict=False):
            code = C.OK if not reply.HasField("error") else _code(reply.error.code)
            if code not in ALLOWED[kind]:
                return code, f"stream message {kind}: {reply.error.message}"
        return C.OK, ""

    _stream_garbage = _stream

    async def _stream_cancelled(self, category: str) -> tuple[C, str]:
        messages = self._stream_messages(int(self.rng.integers(1, 12)), False)
        call = self.stream(iter(body for _, body in messages), timeout=30)
        stop_after = int(self.rng.integers(0, len(messages) + 1))
        got = 0
        try:
            async for _ in call:
                got += 1
                if got >= stop_after:
                    break
        except grpc.aio.AioRpcError as err:
            return err.code(), ""
        call.cancel()
        return (C.CANCELLED if got < len(messages) else C.OK), ""

    async def _stream_abandoned(self, category: str) -> tuple[C, str]:
        # The client writes, never half-closes, and goes away: the server must let go.
        queue: asyncio.Queue = asyncio.Queue()

        async def writer():
            for _, body in self._stream_messages(int(self.rng.integers(1, 6)), False):
                yield body
            await queue.get()  # never half-close

        call = self.stream(writer(), timeout=30)
        await asyncio.sleep(float(self.rng.uniform(0, 0.02)))
        call.cancel()
        try:
            async for _ in call:
                pass
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        return C.CANCELLED, ""

    async def _list_tables(self, category: str) -> tuple[C, str]:
        body = pb.ListTablesRequest().SerializeToString()
        if self.rng.random() < 0.5:
            body = self.req.garbage()
        code, reply = await self.call("ListTables", body)
        if code == C.OK and len(pb.ListTablesResponse.FromString(reply).tables) != 5:
            return code, "ListTables lost a table"
        return code, ""

    async def _describe_table(self, category: str) -> tuple[C, str]:
        name = str(self.rng.choice(["emb_f32", "emb_q8", "", "nope", "é" * 100]))
        if self.rng.random() < 0.3:
            body = self.req.garbage()
        else:
            body = pb.DescribeTableRequest(name=name).SerializeToString()
        return (await self.call("DescribeTable", body))[0], ""

    async def _probe_garbage(self, category: str) -> tuple[C, str]:
        # Health needs no token even when lookups do: garbage there must not reach the log.
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check", _identity, _identity)
        try:
            await check(self.req.garbage(), timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code(), ""
        return C.OK, ""

    async def _unknown_method(self, category: str) -> tuple[C, str]:
        method = str(self.rng.choice(["Nope", "lookup", "Lookup/x", ""]))
        call = self.channel.unary_unary(SERVICE + method, _identity, _identity)
        try:
            await call(self.req.garbage(), timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code(), ""
        return C.OK, ""


def _code(value: int) -> C:
    return next((c for c in C if c.value[0] == value), C.UNKNOWN)


def check_response(
    request: pb.LookupRequest,
    expected: list[tuple[str, np.ndarray]],
    reply: pb.LookupResponse,
    requests: Requests,
) -> str:
    """'' when the reply fits the request (NONE rows bit-exact), else what is wrong."""
    if len(reply.features) != len(expected) or reply.request_id != request.request_id:
        return "wrong features or request id"
    for (name, ids), fi, out in zip(expected, request.features, reply.features, strict=True):
        table = requests.features[name]
        if request.pooling == pb.POOLING_NONE:
            want = table.weight[torch.from_numpy(ids)].contiguous().view(torch.uint8).numpy()
            if out.values != want.tobytes() or list(out.shape) != [ids.size, table.weight.shape[1]]:
                return f"{name}: NONE rows differ from the table"
        else:
            dim = table.weight.shape[1] - (4 if table.quant else 0)
            if list(out.shape) != [len(fi.lengths) // 4, dim]:
                return f"{name}: pooled shape {list(out.shape)}"
    return ""


# -- driver ----------------------------------------------------------------------------------------
async def fuzz(
    target: str,
    cases: int,
    *,
    seed: int = 0,
    concurrency: int = 16,
    check_every: int = 1000,
    probe: Callable[[], dict] = dict,
) -> Findings:
    """Run ``cases`` cases with ``concurrency`` in flight.

    After every ``check_every`` cases (and a short pause for cancelled work to drain),
    ``probe()`` samples the server: ``{"rss": ..., "fds": ..., "alive": ...}`` for a process.
    """
    rng = np.random.default_rng(seed)
    findings = Findings()
    names = list(WEIGHTS)
    p = np.array([WEIGHTS[n] for n in names])
    plan = rng.choice(names, cases, p=p / p.sum())
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        fuzzer = Fuzzer(channel, Requests(fuzz_tables(), rng), findings)
        sem = asyncio.Semaphore(concurrency)

        async def run(category: str) -> None:
            async with sem:
                await fuzzer.case(category)

        for start in range(0, cases, check_every):
            await asyncio.gather(*(run(c) for c in plan[start : start + check_every]))
            findings.cases = min(cases, start + check_every)
            await asyncio.sleep(0.3)  # let cancelled work and closed streams drain
            findings.samples.append({"cases": findings.cases, **probe()})
            if not findings.samples[-1].get("alive", True):
                break
        stub = health_pb2_grpc.HealthStub(channel)
        health = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        findings.samples[-1]["serving"] = health.status == health_pb2.HealthCheckResponse.SERVING
    return findings


EXECUTE_BATCH_ERROR = "ExecuteBatchError raised in core by servicer method"


def _error_excerpts(log: str, limit: int = 3, lines: int = 30) -> list[str]:
    """The first ``limit`` ERROR entries of the server log."""
    text = log.splitlines()
    starts = [i for i, line in enumerate(text) if " ERROR " in line]
    starts = starts[:limit]
    return ["\n".join(text[i : i + lines]) for i in starts]


def _warm_rss(samples: Sequence[dict]) -> float:
    """Server RSS once warmed up: the median of the run's second tenth of samples, or the second
    sample of a short run.

    NOTE(fuzz): RSS climbs ~10 MiB over the first few thousand cases (allocator arenas, grpc's
    and Python's caches meeting new message shapes) and then wanders within a few MiB; one
    sample at 2,000 cases made a flat 50,000-case run read +5.5 % (seed 4; see
    docs/notes/2026-11-30-rss-under-glibc-retention.md).
    """
    if len(samples) < 10:
        return samples[min(1, len(samples) - 1)]["rss"]
    return statistics.median(s["rss"] for s in samples[len(samples) // 10 : len(samples) // 5])


def verdict(findings: Findings, server: ServerProcess, idle: tuple[int, int]) -> dict:
    """Pass/fail of each property, with the figures behind it."""
    warm = findings.samples[min(1, len(findings.samples) - 1)]
    warm_rss = _warm_rss(findings.samples)
    last = findings.samples[-1]
    log = server.log()
    rss_growth = (idle[0] - warm_rss) / warm_rss
    return {
        "unexpected": len(findings.unexpected),
        "server_alive": server.alive(),
        "serving_at_end": last.get("serving", False),
        "tracebacks_in_log": log.count("Traceback"),
        "error_lines_in_log": sum(" ERROR " in line for line in log.splitlines()),
        # grpc's own log line when a reply meets a call the client already cancelled or let
        # expire, which the server logs as a WARNING (ibpembed.server.logs); any ERROR is a
        # finding.
        "grpc_execute_batch_errors": log.count(EXECUTE_BATCH_ERROR),
        "log_errors": _error_excerpts(log),
        "rss_after_warmup_mib": round(warm_rss / 2**20, 1),
        "rss_end_mib": round(idle[0] / 2**20, 1),
        "rss_growth": round(rss_growth, 4),
        "fds_after_warmup": warm["fds"],
        "fds_end": idle[1],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight")
    p.add_argument("--check-every", type=int, default=1000, help="sample RSS/fds every n cases")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ibpembed-fuzz-") as tmp:
        pack_fuzz_set(Path(tmp) / "set", fuzz_tables())
        flags = [
            "--tables",
            str(Path(tmp) / "set"),
            "--max-message-mb",
            str(MAX_MESSAGE_MB),
            "--max-inflight",
            str(MAX_INFLIGHT),
            "--workers",
            "2",
            "--device",
            "cpu",
            # RSS is the leak check: without this, glibc keeps freed response buffers for reuse
            # in every thread's arena (the server's default, up to 256 MiB), and RSS drifts up
            # by that policy, not by leaks (reliability/README.md, RPC fuzz). The soak runs the
            # default.
            "--malloc-retain-mb",
            "0",
        ]
        with ServerProcess(*flags) as server:
            findings = asyncio.run(
                fuzz(
                    server.target,
                    args.cases,
                    seed=args.seed,
                    concurrency=args.concurrency,
                    check_every=min(args.check_every, args.cases),
                    probe=lambda: {
                        "rss": server.rss(),
                        "fds": server.fds(),
                        "alive": server.alive(),
                    },
                )
            )
            idle = settle(server) if server.alive() else (0, 0)
            result = verdict(findings, server, idle)
            exit_code = server.stop()
    result |= {"server_exit_code_on_sigterm": exit_code}
    report = {
        "command": "python -m reliability.fuzz_rpc "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "cases": findings.cases,
        "seconds": round(time.perf_counter() - started, 1),
        "verdict": result,
        "outcomes": {f"{c} -> {code}": n for (c, code), n in sorted(findings.outcomes.items())},
        "unexpected": findings.unexpected,
        "samples": findings.samples,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = (
        not findings.unexpected
        and result["server_alive"]
        and result["serving_at_end"]
        and result["error_lines_in_log"] == 0
        and result["fds_end"] <= result["fds_after_warmup"]
        and result["rss_growth"] < 0.05
    )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
