"""Prometheus metrics: every metric pergrad exports is defined here, in one registry per server.

Several servers may run in one process (the tests start many), so nothing is registered in
prometheus-client's global registry: each `ServerMetrics` owns a `CollectorRegistry` with
the process collectors, the gRPC metrics (go-grpc-prometheus names, filled by
`pergrad.server.transport.interceptors`), pergrad's own `pergrad_*` metrics (per request, filled by
`pergrad.server.tracking`) and, when TensorFlow sees a GPU, GPU memory.
`pergrad.server.transport.metrics_http` exposes a registry over HTTP on a port of its own.

Other modules only call methods of `ServerMetrics`; none creates a metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pergrad.wire.catalogue import NONE
from pergrad.wire.rpc import SERVICE, method_path

# Unary calls take milliseconds to minutes (a large batch of a large model).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# The codes pergrad's own errors map to (pergrad.server.errors), exported from the start.
REJECTION_CODES = tuple(
    grpc.StatusCode[name]
    for name in (
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "UNIMPLEMENTED",
        "INTERNAL",
    )
)


class RpcLabels(NamedTuple):
    """The labels go-grpc-prometheus puts on every gRPC metric."""

    grpc_type: str
    grpc_service: str
    grpc_method: str


class _GpuMemoryCollector(Collector):
    """Memory TensorFlow's allocator holds on each GPU; no samples on a machine without one."""

    def __init__(self) -> None:
        import tensorflow as tf

        self._tf = tf
        count = len(tf.config.list_physical_devices("GPU"))
        self._devices = [f"GPU:{index}" for index in range(count)]

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if not self._devices:
            return
        used = GaugeMetricFamily(
            "pergrad_gpu_memory_used_bytes",
            "GPU memory TensorFlow's allocator holds now.",
            labels=["device"],
        )
        peak = GaugeMetricFamily(
            "pergrad_gpu_memory_peak_bytes",
            "Most GPU memory TensorFlow's allocator has held since the server started.",
            labels=["device"],
        )
        for device in self._devices:
            try:
                info = self._tf.config.experimental.get_memory_info(device)
            except ValueError:  # a device TensorFlow has not initialised
                continue
            used.add_metric([device], info["current"])
            peak.add_metric([device], info["peak"])
        yield used
        yield peak


class ServerMetrics:
    """The metrics of one server, in a registry of its own (`registry`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._arrival = threading.local()
        self._define_process_metrics()
        self._define_rpc_metrics()
        self._define_request_metrics()
        self._define_weights_metrics()
        self._limit = Gauge(
            "pergrad_limit",
            "Each bound's capacity, as this server resolved it (docs/operations.md, Limits).",
            ("limit",),
            registry=self.registry,
        )

    def _define_process_metrics(self) -> None:
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_GpuMemoryCollector())

    def _define_rpc_metrics(self) -> None:
        r = self.registry
        self._started = Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            _RPC_LABELS,
            registry=r,
        )
        self._handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by final status code.",
            (*_RPC_LABELS, "grpc_code"),
            registry=r,
        )
        self._handling = Histogram(
            "grpc_server_handling_seconds",
            "Time from an RPC's arrival to its final status, queueing for a worker included.",
            _RPC_LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._received = Counter(
            "grpc_server_msg_received_total",
            "Request messages received by the server.",
            _RPC_LABELS,
            registry=r,
        )
        self._sent = Counter(
            "grpc_server_msg_sent_total",
            "Response messages the server handed to gRPC to send.",
            _RPC_LABELS,
            registry=r,
        )

    def _define_request_metrics(self) -> None:
        r = self.registry
        self._examples = Counter(
            "pergrad_examples_processed_total",
            "Examples whose per-example gradients (or their reduction) were sent in full.",
            ("model", "reduction"),
            registry=r,
        )
        self._queue = Histogram(
            "pergrad_request_queue_seconds",
            "Time from a gradients call's arrival until work on its request starts: waiting "
            "for a worker thread (about 0 for the later requests of a stream).",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._compute = Histogram(
            "pergrad_request_compute_seconds",
            "Time a request's handler waits for its results: decoding, the engine's "
            "backward pass and chunking, less what overlapped with sending.",
            ("model", "reduction"),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._serialize = Histogram(
            "pergrad_request_serialize_seconds",
            "Time gRPC takes to serialize and send one request's response messages.",
            ("model", "reduction"),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._response_bytes = Counter(
            "pergrad_response_bytes_total",
            "Serialized size of the gradients response messages sent.",
            ("model",),
            registry=r,
        )
        self._requests_in_flight = Gauge(
            "pergrad_requests_in_flight",
            "Gradients requests being computed or sent now.",
            registry=r,
        )
        self._examples_in_flight = Gauge(
            "pergrad_examples_in_flight",
            "Examples of the gradients requests being computed or sent now.",
            registry=r,
        )
        self._rejected = Counter(
            "pergrad_requests_rejected_total",
            "Requests the server refused or failed, by gRPC status code name.",
            ("reason",),
            registry=r,
        )
        for code in REJECTION_CODES:
            self._rejected.labels(code.name)
        self._coalesced = Histogram(
            "pergrad_coalesced_pass_requests",
            "Requests that shared one pass of the model (coalescing, --batch-window-ms).",
            ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self._stalled = Counter(
            "pergrad_stalled_calls_total",
            "Calls cancelled because their client left them waiting (--stall-timeout).",
            ("method",),
            registry=r,
        )
        self._refused_unread = Counter(
            "pergrad_calls_refused_unread_total",
            "Calls refused before their request was read: their caller's requests refused "
            "for what they held came to more than its budget of bytes in the last seconds.",
            ("method",),
            registry=r,
        )
        for name in SERVICE.methods_by_name:  # at 0 from the start, so rates read from it
            self._refused_unread.labels(method_path(name))
            self._stalled.labels(method_path(name))

    def _define_weights_metrics(self) -> None:
        r = self.registry
        self._weights_version = Gauge(
            "pergrad_weights_version",
            "Version of the weights a model serves now (1 at start, +1 per update).",
            ("model",),
            registry=r,
        )
        self._weights_updates = Counter(
            "pergrad_weights_updates_total",
            "Successful weight updates (SetWeights and ApplyStep).",
            ("model",),
            registry=r,
        )
        self._weights_failures = Counter(
            "pergrad_weights_update_failures_total",
            "SetWeights and ApplyStep calls for a served model that failed, changing nothing.",
            ("model",),
            registry=r,
        )

    # gRPC, for pergrad.server.transport.interceptors

    def rpc_started(self, labels: RpcLabels, arrived: float) -> None:
        """An RPC reached its handler; `arrived` (perf_counter) is when the server got it."""
        self._arrival.time = arrived
        self._started.labels(*labels).inc()

    def rpc_message_received(self, labels: RpcLabels) -> None:
        self._received.labels(*labels).inc()

    def rpc_message_sent(self, labels: RpcLabels) -> None:
        self._sent.labels(*labels).inc()

    def rpc_handled(self, labels: RpcLabels, code: grpc.StatusCode, arrived: float) -> None:
        self._arrival.time = None
        self._handled.labels(*labels, code.name).inc()
        self._handling.labels(*labels).observe(time.perf_counter() - arrived)

    # pergrad requests, for pergrad.server.tracking

    def take_arrival(self) -> float | None:
        """When the current call reached the server (set by `rpc_started` on this
        thread), once: a later request of a stream gets None."""
        arrived = getattr(self._arrival, "time", None)
        self._arrival.time = None
        return arrived

    def request_started(self, queue_s: float) -> None:
        self._queue.observe(queue_s)
        self._requests_in_flight.inc()

    def request_ended(self) -> None:
        self._requests_in_flight.dec()

    def examples_started(self, count: int) -> None:
        self._examples_in_flight.inc(count)

    def response_sent(self, model: str, nbytes: int) -> None:
        self._response_bytes.labels(model).inc(nbytes)

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
        self._examples_in_flight.dec(count)
        self._compute.labels(model, reduction).observe(compute_s)
        self._serialize.labels(model, reduction).observe(serialize_s)
        if complete:
            self._examples.labels(model, reduction).inc(count)

    def coalesced_pass(self, model: str, requests: int) -> None:
        """One shared pass of `model` held `requests` requests."""
        self._coalesced.labels(model).observe(requests)

    def call_stalled(self, method: str) -> None:
        self._stalled.labels(method).inc()

    def call_refused_unread(self, method: str) -> None:
        self._refused_unread.labels(method).inc()

    def request_rejected(self, code: grpc.StatusCode) -> None:
        self._rejected.labels(code.name).inc()

    # models and weights

    def limits_set(self, capacities: Mapping[str, float]) -> None:
        """Export each bound's capacity (`admission.limits`)."""
        for name, capacity in capacities.items():
            self._limit.labels(name).set(capacity)

    def model_served(self, model: str, version: int) -> None:
        """Export `model` at `version`, its counters at 0 so rates start from the first call."""
        self.weights_version(model, version)
        self._weights_updates.labels(model)
        self._weights_failures.labels(model)
        self._examples.labels(model, NONE)
        self._response_bytes.labels(model)

    def weights_version(self, model: str, version: int) -> None:
        """The version `model` serves now."""
        self._weights_version.labels(model).set(version)

    def weights_updated(self, model: str, version: int) -> None:
        self._weights_updates.labels(model).inc()
        self.weights_version(model, version)

    def weights_update_failed(self, model: str) -> None:
        """A SetWeights or ApplyStep for a served model that changed nothing."""
        self._weights_failures.labels(model).inc()
