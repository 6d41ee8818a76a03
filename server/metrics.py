"""Prometheus metrics: what a server records, when, in one registry per server (every metric
pergrad exports is defined in `metric_families`).

Several servers may run in one process (the tests start many), so nothing is registered in
prometheus-client's global registry: each `ServerMetrics` owns a `CollectorRegistry` with
the process collectors, the gRPC metrics (go-grpc-prometheus names, filled by
`pergrad.server.transport.interceptors`), pergrad's own `pergrad_*` metrics (per request, filled by
`pergrad.server.tracking`) and, when TensorFlow sees a GPU, GPU memory.
`pergrad.server.transport.metrics_http` exposes a registry over HTTP on a port of its own.

Other modules only call methods of `ServerMetrics`; none but `metric_families` and
`gpu_memory` creates a metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import NamedTuple

import grpc
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)

from pergrad.server.gpu_memory import GpuMemoryCollector
from pergrad.server.metric_families import (
    limit_gauge,
    refusal_families,
    request_families,
    rpc_families,
    weights_families,
)
from pergrad.wire.catalogue import NONE


class RpcLabels(NamedTuple):
    """The labels go-grpc-prometheus puts on every gRPC metric."""

    grpc_type: str
    grpc_service: str
    grpc_method: str


class ServerMetrics:
    """The metrics of one server, in a registry of its own (`registry`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._arrival = threading.local()
        self._define_process_metrics()
        self._rpc = rpc_families(self.registry)
        self._request = request_families(self.registry)
        self._refusal = refusal_families(self.registry)
        self._weights = weights_families(self.registry)
        self._limit = limit_gauge(self.registry)

    def _define_process_metrics(self) -> None:
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(GpuMemoryCollector())

    # gRPC, for pergrad.server.transport.interceptors

    def rpc_started(self, labels: RpcLabels, arrived: float) -> None:
        """An RPC reached its handler; `arrived` (perf_counter) is when the server got it."""
        self._arrival.time = arrived
        self._rpc.started.labels(*labels).inc()

    def rpc_message_received(self, labels: RpcLabels) -> None:
        self._rpc.received.labels(*labels).inc()

    def rpc_message_sent(self, labels: RpcLabels) -> None:
        self._rpc.sent.labels(*labels).inc()

    def rpc_handled(self, labels: RpcLabels, code: grpc.StatusCode, arrived: float) -> None:
        self._arrival.time = None
        self._rpc.handled.labels(*labels, code.name).inc()
        self._rpc.handling.labels(*labels).observe(time.perf_counter() - arrived)

    # pergrad requests, for pergrad.server.tracking

    def take_arrival(self) -> float | None:
        """When the current call reached the server (set by `rpc_started` on this
        thread), once: a later request of a stream gets None."""
        arrived = getattr(self._arrival, "time", None)
        self._arrival.time = None
        return arrived

    def request_started(self, queue_s: float) -> None:
        self._request.queue.observe(queue_s)
        self._request.requests_in_flight.inc()

    def request_ended(self) -> None:
        self._request.requests_in_flight.dec()

    def examples_started(self, count: int) -> None:
        self._request.examples_in_flight.inc(count)

    def response_sent(self, model: str, nbytes: int) -> None:
        self._request.response_bytes.labels(model).inc(nbytes)

    def examples_ended(
        self,
        model: str,
        reduction: str,
        count: int,
        *,
        compute_s: float,
        serialize_s: float,
        complete: bool,
    ) -> None:
        """A request's `count` examples left the server: all sent if `complete`."""
        self._request.examples_in_flight.dec(count)
        self._request.compute.labels(model, reduction).observe(compute_s)
        self._request.serialize.labels(model, reduction).observe(serialize_s)
        if complete:
            self._request.examples.labels(model, reduction).inc(count)

    def coalesced_pass(self, model: str, requests: int) -> None:
        """One shared pass of `model` held `requests` requests."""
        self._refusal.coalesced.labels(model).observe(requests)

    def call_stalled(self, method: str) -> None:
        self._refusal.stalled.labels(method).inc()

    def call_refused_unread(self, method: str) -> None:
        self._refusal.refused_unread.labels(method).inc()

    def request_rejected(self, code: grpc.StatusCode) -> None:
        self._refusal.rejected.labels(code.name).inc()

    # models and weights

    def limits_set(self, capacities: Mapping[str, float]) -> None:
        """Export each bound's capacity (`admission.limits`)."""
        for name, capacity in capacities.items():
            self._limit.labels(name).set(capacity)

    def model_served(self, model: str, version: int) -> None:
        """Export `model` at `version`, its counters at 0 so rates start from the first call."""
        self.weights_version(model, version)
        self._weights.weights_updates.labels(model)
        self._weights.weights_failures.labels(model)
        self._request.examples.labels(model, NONE)
        self._request.response_bytes.labels(model)

    def weights_version(self, model: str, version: int) -> None:
        """The version `model` serves now."""
        self._weights.weights_version.labels(model).set(version)

    def weights_updated(self, model: str, version: int) -> None:
        self._weights.weights_updates.labels(model).inc()
        self.weights_version(model, version)

    def weights_update_failed(self, model: str) -> None:
        """A SetWeights or ApplyStep for a served model that changed nothing."""
        self._weights.weights_failures.labels(model).inc()
