"""`python -m pergrad.server.healthcheck`: exit 0 if the local server reports SERVING.

The container's HEALTHCHECK; Kubernetes uses its native gRPC probes instead. It asks
the standard grpc.health.v1 service, so it needs nothing but grpcio and the health stubs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, *, service: str = "", timeout_s: float = 3.0) -> bool:
    """Whether `target` answers SERVING for `service` within `timeout_s`."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: Sequence[str] | None = None) -> int:
    port = os.environ.get("PERGRAD_PORT", "50051")
    parser = argparse.ArgumentParser(prog="python -m pergrad.server.healthcheck")
    parser.add_argument("--target", default=f"127.0.0.1:{port}", help="server to ask")
    parser.add_argument("--service", default="", help="service name; '' is the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait")
    args = parser.parse_args(argv)
    serving = check(args.target, service=args.service, timeout_s=args.timeout)
    print("SERVING" if serving else "NOT SERVING", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
