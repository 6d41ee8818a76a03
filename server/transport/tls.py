"""TLS for the gRPC port: a certificate and key, and optionally a CA clients must prove.

With `--tls-cert` and `--tls-key` the server speaks only TLS; with `--tls-client-ca` as
well it requires each client to present a certificate that CA signed (mutual TLS).
The Prometheus endpoint stays plain HTTP.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

PEM_MARKER = b"-----BEGIN "


def read_pem(path: Path, flag: str) -> bytes:
    """The bytes of a PEM file; ValueError naming `flag` if unreadable or not PEM."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {str(path)!r} cannot be read: {err.strerror or err}") from None
    if PEM_MARKER not in data:
        raise ValueError(f"{flag} {str(path)!r} is not a PEM file")
    return data


def check_files(cert: Path | None, key: Path | None, client_ca: Path | None) -> None:
    """ValueError naming the flag at fault unless the TLS flags make a usable set: a
    certificate with its own (unencrypted) key, and a client CA only with both."""
    if (cert is None) != (key is None):
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise ValueError(f"{given} needs {missing}")
    if client_ca is not None and cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if cert is None or key is None:
        return
    context = _check_pair(cert, key)
    if client_ca is not None:
        _check_client_ca(context, client_ca)


def _check_pair(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context holding the certificate and its key, or ValueError."""
    read_pem(cert, "--tls-cert")
    read_pem(key, "--tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # no prompt if encrypted
    except ssl.SSLError as err:
        raise ValueError(
            f"--tls-cert {str(cert)!r} and --tls-key {str(key)!r} are not a certificate and "
            f"its unencrypted key: {err.reason or err}"
        ) from None
    return context


def _check_client_ca(context: ssl.SSLContext, client_ca: Path) -> None:
    read_pem(client_ca, "--tls-client-ca")
    try:
        context.load_verify_locations(cafile=client_ca)
    except ssl.SSLError as err:
        raise ValueError(
            f"--tls-client-ca {str(client_ca)!r} holds no usable certificate: {err.reason or err}"
        ) from None


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    """Credentials for `grpc.Server.add_secure_port`; mutual TLS when `client_ca` is given."""
    pair = (read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))
    roots = read_pem(client_ca, "--tls-client-ca") if client_ca is not None else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=roots, require_client_auth=roots is not None
    )
