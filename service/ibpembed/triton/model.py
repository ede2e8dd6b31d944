# SPDX-License-Identifier: Apache-2.0
"""The Triton Python-backend model serving a table set (``ibpembed triton-repo`` writes the
repository; see :mod:`ibpembed.triton.repo` for the tensors).

Each model instance loads its version's table set with the same :class:`TableStore` and
:class:`LookupEngine` as ``ibpembed serve`` and runs every request on the engine's in-process
path (``LookupEngine.run``: Triton already runs one ``execute`` per instance at a time). A bad
request gets a Triton error response whose message names the input at fault (``cat_0__ids:
feature 'cat_0': id 99 out of range ...``); the stub never sees an exception.

``triton_python_backend_utils`` exists only inside Triton's Python stub, so it is imported in
:meth:`TritonPythonModel.initialize`; :class:`TritonLookup` holds everything else and runs
without Triton.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ibpembed.engine import FeatureQuery, KernelCall, LookupEngine
from ibpembed.errors import InvalidArgument, NotFound, ServiceError
from ibpembed.tables.manifest import read_manifest
from ibpembed.tables.store import TableStore
from ibpembed.triton.repo import POOLINGS, FeatureIO, feature_ios, table_set_of

# The engine names a request's fields the way the proto does; Triton users see input names.
_FIELD = re.compile(r"^features\[(\d+)\]\.(ids|lengths|weights)")


class InputError(Exception):
    """A request Triton should answer with an error; ``code`` is the Triton error code name."""

    def __init__(self, message: str, code: str = "INVALID_ARG") -> None:
        super().__init__(message)
        self.code = code


# The server's latency buckets (ibpembed.server.metrics.LATENCY_BUCKETS_S, not imported: that
# module pulls in grpc, which the Triton model does not need; a test keeps the two equal).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True)
class Answer:
    """One request's outputs by name and the pooling that made them."""

    outputs: dict[str, torch.Tensor]
    pooling: str


class TritonLookup:
    """One model instance's lookups, free of Triton's own types.

    Parameters
    ----------
    tables : the table set directory.
    pooling : the model's pooling (``sum``, ``mean`` or ``none``).
    device : the engine's device.
    features : the features the model's config lists (default: all the pooling can serve).
    """

    def __init__(
        self,
        tables: str | Path,
        pooling: str,
        device: str = "cpu",
        features: Sequence[str] | None = None,
        observer: Any = None,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.ios: list[FeatureIO] = feature_ios(read_manifest(tables), pooling, features)
        self.store = TableStore.load(tables)
        # One worker: run() executes on the caller's thread; the pool only backs submit().
        self.engine = LookupEngine(self.store, max_workers=1, device=device, observer=observer)
        self._by_input = {}
        for io in self.ios:
            for name in (io.ids, io.lengths, io.weights):
                self._by_input[name] = io

    def lookup(
        self,
        inputs: Mapping[str, np.ndarray],
        requested: Sequence[str] = (),
        pooling: str | None = None,
    ) -> Answer:
        """The outputs for one request's inputs (numpy arrays by input name).

        Parameters
        ----------
        requested : output names the client asked for; empty = all. Triton fills in every
            output of the config when a client names none, so an output is returned only for
            the features the request sent (asking for one it did not send gives no tensor).
        pooling : a ``pooling`` request parameter: ``sum`` or ``mean`` on a pooled model.

        Raises
        ------
        InputError
            naming the input (or parameter, or output) at fault.
        """
        pooling = self._pooling_for(pooling)
        sent: dict[str, FeatureIO] = {}
        for name in inputs:
            io = self._by_input.get(name)
            if io is None:  # Triton checks names against the config; this is a second guard
                raise InputError(f"unexpected input '{name}'", "NOT_FOUND")
            sent[io.feature] = io
        if not sent:
            raise InputError("the request has no input: send <feature>__ids and __lengths")
        queries = []
        for feature in sorted(sent):
            io = sent[feature]
            for needed in (io.ids, io.lengths):
                if needed not in inputs:
                    raise InputError(
                        f"input '{needed}' is missing: feature '{feature}' needs both "
                        f"'{io.ids}' and '{io.lengths}'"
                    )
            weights = inputs.get(io.weights)
            if weights is not None and pooling == "none":
                raise InputError(f"input '{io.weights}': weights need pooling sum or mean")
            queries.append(FeatureQuery(feature, inputs[io.ids], inputs[io.lengths], weights))
        outputs = {sent[f].output(pooling): sent[f] for f in sent}
        try:
            result = self.engine.run(queries, pooling)  # type: ignore[arg-type]
        except InvalidArgument as err:
            raise InputError(self._named(err, queries)) from None
        except NotFound as err:
            raise InputError(str(err), "NOT_FOUND") from None
        except ServiceError as err:
            raise InputError(str(err), "UNAVAILABLE") from None
        wanted = set(requested) if requested else set(outputs)
        out = {}
        for query, feature_result in zip(queries, result.features, strict=True):
            name = sent[query.name].output(pooling)
            if name in wanted:
                out[name] = feature_result.values
        return Answer(out, pooling)

    def _pooling_for(self, requested: str | None) -> str:
        if requested is None or requested == self.pooling:
            return self.pooling
        if self.pooling == "none" or requested not in ("sum", "mean"):
            allowed = ["none"] if self.pooling == "none" else ["sum", "mean"]
            raise InputError(
                f"parameter 'pooling': this model answers {allowed} (its outputs' dtype is "
                f"fixed by its config), got {requested!r}"
            )
        return requested

    @staticmethod
    def _named(err: InvalidArgument, queries: Sequence[FeatureQuery]) -> str:
        """The engine's message with its proto field name replaced by the Triton input's."""
        match = _FIELD.match(err.field)
        if match is None:
            return str(err)
        k, part = int(match.group(1)), match.group(2)
        name = f"{queries[k].name}__{part}"
        return name + str(err)[match.end() :]

    def close(self) -> None:
        self.engine.close()


class _Metrics:
    """The server's metric names, where Triton's Python backend can expose them (its custom
    metrics appear on Triton's own ``/metrics``, next to ``nv_inference_*``)."""

    def __init__(self, pb_utils: Any, model: str, version: str, lookup: TritonLookup) -> None:
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": version}
        self._requests = family(
            name="ibpembed_requests_total",
            description="Lookup requests answered, by Triton error code (OK for success)",
            kind=family.COUNTER,
        )
        self._rows = family(
            name="ibpembed_rows_looked_up_total",
            description="Ids looked up (rows gathered), by table and pooling",
            kind=family.COUNTER,
        )
        self._labels = labels
        self._by_code: dict[str, Any] = {}
        self._by_table: dict[tuple[str, str], Any] = {}
        raw = family(
            name="ibpembed_table_raw_bytes",
            description="Bytes of the table's rows uncompressed",
            kind=family.GAUGE,
        )
        stored = family(
            name="ibpembed_table_stored_bytes",
            description="Bytes the table keeps: compressed payload, index and masks",
            kind=family.GAUGE,
        )
        # Held for the model's lifetime though never read again: a MetricFamily the Python
        # backend frees deletes itself and its metrics (the gauges set below) from Triton.
        self._gauges = (raw, stored)
        self._latency = family(
            name="ibpembed_lookup_duration_seconds",
            description="Lookup latency inside the model (inputs read to outputs ready)",
            kind=family.HISTOGRAM,
        )
        self._by_pooling: dict[str, Any] = {}
        for table, acct in lookup.store.accounting().items():
            raw.Metric(labels={**labels, "table": table}).set(acct.raw)
            stored.Metric(labels={**labels, "table": table}).set(acct.stored)

    def request_done(self, code: str) -> None:
        metric = self._by_code.get(code)
        if metric is None:
            metric = self._requests.Metric(labels={**self._labels, "code": code})
            self._by_code[code] = metric
        metric.increment(1)

    def lookup_done(self, pooling: str, seconds: float) -> None:
        metric = self._by_pooling.get(pooling)
        if metric is None:
            metric = self._latency.Metric(
                labels={**self._labels, "pooling": pooling}, buckets=list(LATENCY_BUCKETS_S)
            )
            self._by_pooling[pooling] = metric
        metric.observe(seconds)

    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        for table, nnz, _unique, _seconds in calls:
            key = (table, pooling)
            metric = self._by_table.get(key)
            if metric is None:
                metric = self._rows.Metric(
                    labels={**self._labels, "table": table, "pooling": pooling}
                )
                self._by_table[key] = metric
            metric.increment(nnz)


class _Observer:
    """Forwards the engine's kernel reports to the metrics once they exist."""

    def __init__(self) -> None:
        self.metrics: _Metrics | None = None

    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        if self.metrics is not None:
            self.metrics.kernels_done(pooling, calls)


class TritonPythonModel:
    """Triton's entry points (``initialize``, ``execute``, ``finalize``)."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        features = sorted(
            {i["name"].rsplit("__", 1)[0] for i in config["input"] if i["name"].endswith("__ids")}
        )
        version_dir = Path(args["model_repository"]) / args["model_version"]
        observer = _Observer()
        self.lookup = TritonLookup(
            table_set_of(version_dir),
            params.get("pooling", "sum"),
            params.get("device", "cpu"),
            features,
            observer,
        )
        self.metrics: _Metrics | None = None
        if hasattr(pb_utils, "MetricFamily"):
            self.metrics = _Metrics(
                pb_utils, args["model_name"], args["model_version"], self.lookup
            )
            observer.metrics = self.metrics

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: Any) -> Any:
        pb = self._pb
        start = time.perf_counter()
        try:
            inputs = {t.name(): _as_numpy(t) for t in request.inputs()}
            params = json.loads(request.parameters() or "{}")
            pooling = params.get("pooling")
            if pooling is not None and not isinstance(pooling, str):
                raise InputError(f"parameter 'pooling' must be a string, got {pooling!r}")
            answer = self.lookup.lookup(inputs, request.requested_output_names(), pooling)
            tensors = [pb.Tensor.from_dlpack(n, _dlpackable(v)) for n, v in answer.outputs.items()]
            # No response parameters: the 2.51 backend's InferenceResponse has none. Triton's own
            # model_version names the version directory, hence the table set, that answered.
            response = pb.InferenceResponse(output_tensors=tensors)
            code = "OK"
            if self.metrics is not None:
                self.metrics.lookup_done(answer.pooling, time.perf_counter() - start)
        except InputError as err:
            code = err.code
            response = pb.InferenceResponse(error=pb.TritonError(str(err), _code(pb, code)))
        except Exception as err:  # a bug: answered, logged, and the instance stays up
            code = "INTERNAL"
            pb.Logger.log_error(f"ibpembed: lookup failed: {type(err).__name__}: {err}")
            message = f"internal error: {type(err).__name__}: {err}"
            response = pb.InferenceResponse(error=pb.TritonError(message, _code(pb, code)))
        if self.metrics is not None:
            self.metrics.request_done(code)
        return response

    def finalize(self) -> None:
        self.lookup.close()


def _code(pb_utils: Any, name: str) -> Any:
    return getattr(pb_utils.TritonError, name, pb_utils.TritonError.INTERNAL)


def _dlpackable(values: torch.Tensor) -> torch.Tensor:
    # Triton reads the output through DLPack: it must be contiguous (a pooled view of a wider
    # result is not).
    return values.contiguous()


def _as_numpy(tensor: Any) -> np.ndarray:
    """A request input as numpy, through DLPack.

    ``Tensor.as_numpy()`` of the 2.51 stub was built against numpy 1.x: under numpy 2 its arrays
    have the right shape and dtype but a zero stride (every element reads as the first), so the
    inputs are read through torch's DLPack instead.
    """
    return torch.from_dlpack(tensor.to_dlpack()).numpy()
