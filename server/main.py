"""Starting a server: load the models, start gRPC with health and reflection and /metrics;
`RunningServer.stop` drains. `pergrad serve` (`pergrad.server.serve`) runs it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health_pb2_grpc

from pergrad.server.admission.inflight import Admission
from pergrad.server.admission.limits import Capacities, resolve
from pergrad.server.admission.unparsed import Unparsed, request_bytes_limit
from pergrad.server.config import JIT_CHOICES, Config
from pergrad.server.devices import with_coalescing_resolved
from pergrad.server.metrics import ServerMetrics
from pergrad.server.models.builtin import BUILTIN_MODELS
from pergrad.server.models.registry import ModelRegistry, load_model
from pergrad.server.service import GradientServicer, add_to_server
from pergrad.server.sharing import Coalescers
from pergrad.server.status import Refusal
from pergrad.server.training import make_optimizer
from pergrad.server.transport.auth import TokenAuthInterceptor, load_tokens
from pergrad.server.transport.guard import CallGuard
from pergrad.server.transport.health import SERVICE_NAME as HEALTH_SERVICE
from pergrad.server.transport.health import SERVING, HealthService
from pergrad.server.transport.interceptors import MetricsInterceptor
from pergrad.server.transport.metrics_http import MetricsEndpoint, serve_metrics
from pergrad.server.transport.reflection import add_reflection
from pergrad.server.transport.tls import server_credentials
from pergrad.wire.rpc import SERVICE_NAME

_LOGGER = logging.getLogger(__name__)


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: HealthService
    metrics: ServerMetrics
    metrics_endpoint: MetricsEndpoint
    guard: CallGuard
    coalescers: Coalescers
    # Health and reflection's own server (--open-services-port), else None; and their
    # port (`port` where they share the service's server).
    open_server: grpc.Server | None
    open_port: int
    # Each bound's capacity (`admission.limits`), as this server resolved them.
    limits: Capacities

    @property
    def metrics_port(self) -> int:
        """The port of http://host:metrics_port/metrics."""
        return self.metrics_endpoint.port

    def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING (ending health Watch streams), let in-flight calls finish for
        up to `grace_s`, stop metrics."""
        self.health.stop_serving()
        self.server.stop(grace_s).wait()
        if self.open_server is not None:  # probes heard NOT_SERVING through the drain
            self.open_server.stop(0).wait()
        self.coalescers.close()
        self.guard.close()
        self.metrics_endpoint.close()


def build_registry(config: Config) -> ModelRegistry:
    specs = config.models or tuple(BUILTIN_MODELS)
    optimizer = config.optimizer_spec
    make_optimizer(optimizer)  # a bad --optimizer stops the start before any model loads
    return ModelRegistry(
        load_model(
            spec,
            model_dir=config.model_dir,
            loss=config.loss,
            jit_compile=JIT_CHOICES[config.jit_compile],
            optimizer=optimizer,
            lora=config.lora_spec,
        )
        for spec in specs
    )


def server_options(config: Config, limits: Capacities) -> list[tuple[str, int]]:
    """Message limits, and a keepalive policy that admits the client's pings (one a
    minute, `pergrad.client._channels`); connections end after max_connection_age so
    clients re-resolve and spread over replicas added since."""
    age_ms = int(1000 * config.max_connection_age_s)
    return [
        ("grpc.max_receive_message_length", limits.count("message_bytes")),
        ("grpc.max_send_message_length", -1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.max_connection_age_ms", age_ms),
        ("grpc.max_connection_age_grace_ms", int(1000 * config.grace_s) + 30_000),
    ]


def _server_metrics(registry: ModelRegistry, limits: Capacities) -> ServerMetrics:
    """The server's metrics, every bound's capacity and every model's version set."""
    metrics = ServerMetrics()
    metrics.limits_set(limits)
    for name in registry.names:
        metrics.model_served(name, registry.get(name).weights.current.version)
    return metrics


def start(config: Config, registry: ModelRegistry | None = None) -> RunningServer:
    """Start serving gRPC and /metrics (port 0 picks a free one); returns at once."""
    registry = registry or build_registry(config)
    config = with_coalescing_resolved(config)
    config = replace(config, max_request_bytes=request_bytes_limit(config, registry))
    _LOGGER.info("--max-request-bytes %d", config.max_request_bytes)
    limits = resolve(config)
    metrics = _server_metrics(registry, limits)
    assert config.metrics_port is not None  # derived in Config.__post_init__ where unset
    endpoint = serve_metrics(metrics, config.host, config.metrics_port)
    admission = Admission(
        max_examples=limits.count("inflight_examples"), max_bytes=limits.count("inflight_bytes")
    )
    guard = CallGuard(limits, admission, metrics, tokens=config.auth_token_file is not None)
    coalescers = Coalescers(
        window_ms=config.batch_window_ms,
        max_coalesced_batch=config.max_coalesced_batch,
        on_pass=metrics.coalesced_pass,
    )
    try:
        servicer = GradientServicer(registry, config, metrics, coalescers, admission)
        refusals = Unparsed(registry).by_method()
        grpc_servers = _start_grpc(config, limits, servicer, refusals, guard)
    except BaseException:
        guard.close()
        endpoint.close()
        raise
    server, open_server, health_servicer, port, open_port = grpc_servers
    _LOGGER.info(
        "pergrad ready on %s:%d serving %s (health and reflection on port %d), metrics on "
        "http://%s:%d/metrics",
        config.host,
        port,
        registry.names,
        open_port,
        config.host,
        endpoint.port,
    )
    return RunningServer(
        server,
        port,
        health_servicer,
        metrics,
        endpoint,
        guard,
        coalescers,
        open_server,
        open_port,
        limits,
    )


def _start_grpc(
    config: Config,
    limits: Capacities,
    servicer: GradientServicer,
    refusals: Mapping[str, Refusal],
    guard: CallGuard,
) -> tuple[grpc.Server, grpc.Server | None, HealthService, int, int]:
    """(the service's server, health and reflection's own or None, the health servicer,
    the service's port, health and reflection's port), started."""
    server = grpc.server(
        # A thread per call admitted: waiting for a request takes one; computing takes
        # one of the guard's --workers places besides (`CallGuard`).
        futures.ThreadPoolExecutor(max_workers=limits.count("calls")),
        # Metrics outermost (they see every final status), then tokens, then the guard.
        interceptors=[MetricsInterceptor(servicer.metrics), *_auth_interceptors(config), guard],
        options=server_options(config, limits),
        maximum_concurrent_rpcs=limits.count("grpc_calls"),
    )
    add_to_server(servicer, server, refusals)
    own = (
        _open_services_server(config, limits, servicer, guard)
        if config.open_services_port is not None
        else None
    )
    open_server = own or server
    health_servicer = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, open_server)
    # Reflection lists what its port serves: the service too only where they share one.
    served = [HEALTH_SERVICE] if own is not None else [SERVICE_NAME, HEALTH_SERVICE]
    add_reflection(served, open_server)
    try:
        port = _add_port(server, config, config.port)
        open_port = port if own is None else _add_port(own, config, config.open_services_port or 0)
        server.start()
        if own is not None:
            own.start()
    except BaseException:  # a port that will not bind: let go of the other
        for started in (server, own):
            if started is not None:
                started.stop(0)
        raise
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, SERVING)
    return server, own, health_servicer, port, open_port


def _open_services_server(
    config: Config,
    limits: Capacities,
    servicer: GradientServicer,
    guard: CallGuard,
) -> grpc.Server:
    """Health and reflection's own server: gRPC's C core refuses its requests over
    OPEN_REQUEST_BYTES before Python copies them (on a server shared with the service,
    they are copied up to --max-request-bytes first: `benchmarks/attacks.py` row 16), and
    holds each connection to its share of the open calls' places (`open_connection_calls`:
    a connection's further calls wait on the client's side, before any Python thread, so
    one caller's silent calls cannot keep every place from a kubelet's probe); the
    service's port then serves nothing a caller without a token can reach."""
    own = {
        "grpc.max_receive_message_length": limits.count("open_request_bytes"),
        "grpc.max_concurrent_streams": limits.count("open_connection_calls"),
    }
    options = [*{**dict(server_options(config, limits)), **own}.items()]
    return grpc.server(
        # refusals; calls run on the guard's pools
        futures.ThreadPoolExecutor(max_workers=limits.count("open_calls")),
        interceptors=[MetricsInterceptor(servicer.metrics), guard],
        options=options,
        maximum_concurrent_rpcs=limits.count("open_grpc_calls"),
    )


def _auth_interceptors(config: Config) -> list[grpc.ServerInterceptor]:
    """Token checks, after the metrics interceptor so that refused calls are counted."""
    if config.auth_token_file is None:
        return []
    return [TokenAuthInterceptor(load_tokens(config.auth_token_file))]


def _add_port(server: grpc.Server, config: Config, port: int) -> int:
    """Listen on host:port, with TLS when a certificate is configured; the bound port."""
    address = f"{config.host}:{port}"
    if config.tls_cert is None or config.tls_key is None:
        bound = server.add_insecure_port(address)
    else:
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound
