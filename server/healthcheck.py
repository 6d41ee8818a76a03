"""`python -m pergrad.server.healthcheck`: exit 0 if the local server reports SERVING.

The container's HEALTHCHECK and the Kubernetes exec probes of a TLS deployment (the
native gRPC probes speak no TLS). It asks the standard grpc.health.v1 service, and reads
the variables the server itself reads, so a probe needs no flags:
- PERGRAD_OPEN_SERVICES_PORT, or without it PERGRAD_PORT: the port asked, on 127.0.0.1;
- PERGRAD_TLS_CERT: when set, the server speaks only TLS, and so does the probe. It trusts
  PERGRAD_TLS_CA (the CA that signed the server's certificate) or, without it, the
  server's own certificate file (self-signed, or a chain that includes its CA);
- PERGRAD_TLS_CLIENT_CA: when set (mutual TLS), the probe presents the server's own
  certificate and key (PERGRAD_TLS_CERT, PERGRAD_TLS_KEY), which must then allow client
  authentication too, unless --tls-cert and --tls-key name another pair;
- PERGRAD_TLS_SERVER_NAME: the name the server's certificate holds, where it is not the
  target's host (a certificate for the Service's DNS name, probed on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class Tls:
    """PEM files of a TLS probe: the CA to trust, and a client pair for mutual TLS."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def channel(self, target: str) -> grpc.Channel:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )
        name = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(target, credentials, options=name)


def check(
    target: str, *, service: str = "", timeout_s: float = 3.0, tls: Tls | None = None
) -> bool:
    """Whether `target` answers SERVING for `service` within `timeout_s`."""
    channel = tls.channel(target) if tls else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _env(name: str) -> str | None:
    return os.environ.get(f"PERGRAD_{name}") or None


def _tls(args: argparse.Namespace) -> Tls | None:
    """TLS as the server is configured, from the flags or else the server's variables."""
    server_cert, server_key = _env("TLS_CERT"), _env("TLS_KEY")
    ca = args.tls_ca or _env("TLS_CA") or server_cert
    cert, key = args.tls_cert, args.tls_key
    if cert is None and key is None and _env("TLS_CLIENT_CA"):
        cert, key = server_cert, server_key
    if ca is None:
        return None
    return Tls(ca, cert, key, args.server_name or _env("TLS_SERVER_NAME"))


def main(argv: Sequence[str] | None = None) -> int:
    port = _env("OPEN_SERVICES_PORT") or _env("PORT") or "50051"
    parser = argparse.ArgumentParser(prog="python -m pergrad.server.healthcheck")
    parser.add_argument("--target", default=f"127.0.0.1:{port}", help="server to ask")
    parser.add_argument("--service", default="", help="service name; '' is the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait")
    parser.add_argument("--tls-ca", help="PEM of the CA that signs the server (PERGRAD_TLS_CA)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--server-name", help="name in the server's certificate")
    args = parser.parse_args(argv)
    try:
        serving = check(args.target, service=args.service, timeout_s=args.timeout, tls=_tls(args))
    except (OSError, ValueError) as err:
        print(f"NOT SERVING: {err}", file=sys.stderr)
        return 1
    print("SERVING" if serving else "NOT SERVING", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
