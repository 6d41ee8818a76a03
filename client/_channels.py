"""Channels to one server or many: gRPC's resolver and round_robin do the spreading.

`ipv4:h1:50051,h2:50051` names a fixed list, `dns:///name:50051` a Kubernetes headless
Service (every A record is a replica). Calls go through one channel whose service config
picks `round_robin` and retries UNAVAILABLE; calls that must reach every replica
(SetWeights) use one channel per address.
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Iterable
from typing import Any

import grpc
import grpc.experimental

from pergrad.client._credentials import Security
from pergrad.client._methods import Methods
from pergrad.client._retry import BACKOFF_GROWTH, FIRST_BACKOFF_S, MAX_BACKOFF_S, RETRYABLE
from pergrad.client._types import PergradError
from pergrad.wire.rpc import SERVICE, SERVICE_NAME

MAX_RECEIVE_BYTES = 64 << 20

# Retries happen only before a response arrives; a replica that dies mid-stream is
# retried by the client itself (`_retry`). Only methods sent as one message are retried
# by gRPC: a request-streaming call under a retry policy could outlive its deadline,
# never ending, once its server stopped (grpcio 1.85; grpc/grpc#41036).
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [
                {"service": SERVICE_NAME, "method": method.name}
                for method in SERVICE.methods
                if not method.client_streaming
            ],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": f"{FIRST_BACKOFF_S}s",
                "maxBackoff": f"{MAX_BACKOFF_S}s",
                "backoffMultiplier": BACKOFF_GROWTH,
                "retryableStatusCodes": [code.name for code in RETRYABLE],
            },
        }
    ],
}

# Keepalive pings every 60 s, within what the server permits (one per 30 s). A unary-stream
# call (ComputePerExampleGradients, GetWeights) reads its responses on the calling thread:
# by default grpcio starts a thread per such call to poll it, which cost about a
# millisecond of every small call here.
CHANNEL_OPTIONS = [
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", -1),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Subchannels of this channel's own: gRPC shares them across a process's channels by
    # default, so a new client of a server that restarted on the same port (or of a new
    # server on a port the system reused) inherited the old connection's failure backoff
    # and failed at once with UNAVAILABLE (seen in tests/server/test_steps.py).
    ("grpc.use_local_subchannel_pool", 1),
]


def open_channel(
    target: str,
    options: Iterable[tuple[str, Any]] = (),
    security: Security | None = None,
    *,
    replica_of: str | None = None,
) -> grpc.Channel:
    """A channel to `target` with the client's options and credentials (none by default);
    `replica_of` is the target that `target` is one replica of."""
    security = security or Security()
    names = tls_name_options(replica_of or target, security)
    return security.open(target, [*CHANNEL_OPTIONS, *names, *options])


def tls_name_options(target: str, security: Security) -> list[tuple[str, Any]]:
    """Under TLS, the name the servers' certificates are checked against where it is not
    the channel's own host: `security.server_name`, else the name of a dns: target (its
    replicas are opened by address). An ipv4:/ipv6: list names no host: ValueError."""
    if not security.tls:
        return []
    name = security.server_name or _dns_host(target)
    if name is None and target.partition(":")[0] in ("ipv4", "ipv6"):
        raise ValueError(
            f"TLS to {target!r} needs server_name=, a name every replica's certificate holds"
        )
    return [("grpc.ssl_target_name_override", name)] if name else []


def _dns_host(target: str) -> str | None:
    """The name of a "dns:///name:50051" or "dns://authority/name:50051" target, else None."""
    scheme, _, rest = target.partition(":")
    if scheme != "dns":
        return None
    host = rest.lstrip("/").rpartition(":")[0]
    return host.split("/", 1)[1] if "/" in host else host


def _address(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def replica_addresses(target: str) -> list[str]:
    """Every server `target` names: the list of an ipv4:/ipv6: target, the A records of
    a dns: target, else the target itself."""
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return rest.split(",")
    if scheme == "dns":
        host, _, port = rest.lstrip("/").rpartition(":")
        if "/" in host:  # dns://authority/name:port
            host = host.split("/", 1)[1]
        try:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise PergradError(
                grpc.StatusCode.UNAVAILABLE,
                f"{target!r}: cannot resolve {host!r} ({err.strerror}); check the name, or "
                "call from where it resolves (a headless Service's: inside its cluster)",
            ) from None
        return sorted({_address(str(a[0]), int(a[1])) for *_, a in found})
    return [target]


class Replicas:
    """The servers a target names, resolved at first use (as gRPC's channels resolve
    theirs: a client may be made before its Service exists), and a channel to each, opened
    when a call must reach every one of them (`set_weights`, a step's update)."""

    def __init__(
        self,
        target: str,
        options: list[tuple[str, Any]],
        security: Security,
        methods: Methods,
    ) -> None:
        self._target, self._options, self._security = target, options, security
        self._methods = methods
        self._channels: list[grpc.Channel] = []
        self._each: list[Methods] = []

    @functools.cached_property
    def addresses(self) -> list[str]:
        return replica_addresses(self._target)

    def methods(self) -> list[Methods]:
        """The service's methods on each replica: the client's own where there is one."""
        if len(self.addresses) == 1:
            return [self._methods]
        if not self._channels:
            self._channels = [
                open_channel(a, self._options, self._security, replica_of=self._target)
                for a in self.addresses
            ]
            self._each = [Methods(c) for c in self._channels]
        return self._each

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
