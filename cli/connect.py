"""The flags that say where a server is and how to trust it, and the client they make.

Each has an environment default: PERGRAD_TARGET, PERGRAD_TLS_CA (the same variable the
server's health check reads), PERGRAD_TOKEN for the token itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pergrad.client import GradientClient, Security


def add_connection_arguments(cmd: argparse.ArgumentParser) -> None:
    target = os.environ.get("PERGRAD_TARGET", "localhost:50051")
    cmd.add_argument("--target", default=target, help="server address (PERGRAD_TARGET)")
    cmd.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    cmd.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    cmd.add_argument(
        "--tls-ca",
        default=os.environ.get("PERGRAD_TLS_CA") or None,
        help="PEM of the CA that signs the server (implies --tls; PERGRAD_TLS_CA)",
    )
    cmd.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    cmd.add_argument("--tls-key", help="PEM private key of --tls-cert")
    cmd.add_argument("--token-file", help="file holding the bearer token (default: PERGRAD_TOKEN)")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SystemExit(f"pergrad: {flag} {path!r} cannot be read: {err.strerror}") from None


def security(args: argparse.Namespace) -> Security:
    """The client's credentials from the flags (and PERGRAD_TOKEN)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("pergrad: --tls-cert and --tls-key go together")
    token = os.environ.get("PERGRAD_TOKEN", "").strip() or None
    if args.token_file:
        token = _read(args.token_file, "--token-file").decode().strip()
        if not token:
            raise SystemExit(f"pergrad: --token-file {args.token_file!r} is empty")

    def pem(path: str | None, flag: str) -> bytes | None:
        return _read(path, flag) if path else None

    return Security.of(
        tls=args.tls,
        token=token,
        root_certificates=pem(args.tls_ca, "--tls-ca"),
        certificate_chain=pem(args.tls_cert, "--tls-cert"),
        private_key=pem(args.tls_key, "--tls-key"),
    )


def connect(args: argparse.Namespace) -> GradientClient:
    return GradientClient(args.target, timeout=args.timeout, security=security(args))
