"""Every metric pergrad exports, defined: name, help, labels and buckets, in families by
what they describe, each made in a server's own registry (`ServerMetrics` records them).
"""

from __future__ import annotations

from typing import NamedTuple

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pergrad.wire.rpc import SERVICE, method_path

# Unary calls take milliseconds to minutes (a large batch of a large model).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# The codes pergrad's own errors map to (pergrad.server.errors), exported from the start.
_REJECTED = (
    "INVALID_ARGUMENT NOT_FOUND FAILED_PRECONDITION RESOURCE_EXHAUSTED UNIMPLEMENTED INTERNAL"
)
REJECTION_CODES = tuple(grpc.StatusCode[name] for name in _REJECTED.split())


class RpcFamilies(NamedTuple):
    """gRPC's own, by go-grpc-prometheus's names (filled by `transport.interceptors`)."""

    started: Counter
    handled: Counter
    handling: Histogram
    received: Counter
    sent: Counter


def rpc_families(registry: CollectorRegistry) -> RpcFamilies:
    return RpcFamilies(
        Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            RPC_LABELS,
            registry=registry,
        ),
        Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by final status code.",
            (*RPC_LABELS, "grpc_code"),
            registry=registry,
        ),
        Histogram(
            "grpc_server_handling_seconds",
            "Time from an RPC's arrival to its final status, queueing for a worker included.",
            RPC_LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ),
        Counter(
            "grpc_server_msg_received_total",
            "Request messages received by the server.",
            RPC_LABELS,
            registry=registry,
        ),
        Counter(
            "grpc_server_msg_sent_total",
            "Response messages the server handed to gRPC to send.",
            RPC_LABELS,
            registry=registry,
        ),
    )


class RequestFamilies(NamedTuple):
    """A gradients request's life (filled by `tracking`)."""

    examples: Counter
    queue: Histogram
    compute: Histogram
    serialize: Histogram
    response_bytes: Counter
    requests_in_flight: Gauge
    examples_in_flight: Gauge


def request_families(registry: CollectorRegistry) -> RequestFamilies:
    return RequestFamilies(
        Counter(
            "pergrad_examples_processed_total",
            "Examples whose per-example gradients (or their reduction) were sent in full.",
            ("model", "reduction"),
            registry=registry,
        ),
        Histogram(
            "pergrad_request_queue_seconds",
            "Time from a gradients call's arrival until work on its request starts: waiting "
            "for a worker thread (about 0 for the later requests of a stream).",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ),
        Histogram(
            "pergrad_request_compute_seconds",
            "Time a request's handler waits for its results: decoding, the engine's "
            "backward pass and chunking, less what overlapped with sending.",
            ("model", "reduction"),
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ),
        Histogram(
            "pergrad_request_serialize_seconds",
            "Time gRPC takes to serialize and send one request's response messages.",
            ("model", "reduction"),
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ),
        Counter(
            "pergrad_response_bytes_total",
            "Serialized size of the gradients response messages sent.",
            ("model",),
            registry=registry,
        ),
        Gauge(
            "pergrad_requests_in_flight",
            "Gradients requests being computed or sent now.",
            registry=registry,
        ),
        Gauge(
            "pergrad_examples_in_flight",
            "Examples of the gradients requests being computed or sent now.",
            registry=registry,
        ),
    )


class RefusalFamilies(NamedTuple):
    """Calls refused, cancelled or sharing a pass."""

    rejected: Counter
    coalesced: Histogram
    stalled: Counter
    refused_unread: Counter


def refusal_families(registry: CollectorRegistry) -> RefusalFamilies:
    families = RefusalFamilies(
        Counter(
            "pergrad_requests_rejected_total",
            "Requests the server refused or failed, by gRPC status code name.",
            ("reason",),
            registry=registry,
        ),
        Histogram(
            "pergrad_coalesced_pass_requests",
            "Requests that shared one pass of the model (coalescing, --batch-window-ms).",
            ("model",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        ),
        Counter(
            "pergrad_stalled_calls_total",
            "Calls cancelled because their client left them waiting (--stall-timeout).",
            ("method",),
            registry=registry,
        ),
        Counter(
            "pergrad_calls_refused_unread_total",
            "Calls refused before their request was read: their caller's requests refused "
            "for what they held came to more than its budget of bytes in the last seconds.",
            ("method",),
            registry=registry,
        ),
    )
    for code in REJECTION_CODES:
        families.rejected.labels(code.name)
    for name in SERVICE.methods_by_name:  # at 0 from the start, so rates read from it
        families.refused_unread.labels(method_path(name))
        families.stalled.labels(method_path(name))
    return families


class WeightsFamilies(NamedTuple):
    """Each served model's weights."""

    weights_version: Gauge
    weights_updates: Counter
    weights_failures: Counter


def weights_families(registry: CollectorRegistry) -> WeightsFamilies:
    return WeightsFamilies(
        Gauge(
            "pergrad_weights_version",
            "Version of the weights a model serves now (1 at start, +1 per update).",
            ("model",),
            registry=registry,
        ),
        Counter(
            "pergrad_weights_updates_total",
            "Successful weight updates (SetWeights and ApplyStep).",
            ("model",),
            registry=registry,
        ),
        Counter(
            "pergrad_weights_update_failures_total",
            "SetWeights and ApplyStep calls for a served model that failed, changing nothing.",
            ("model",),
            registry=registry,
        ),
    )


def limit_gauge(registry: CollectorRegistry) -> Gauge:
    return Gauge(
        "pergrad_limit",
        "Each bound's capacity, as this server resolved it (docs/operations.md, Limits).",
        ("limit",),
        registry=registry,
    )
