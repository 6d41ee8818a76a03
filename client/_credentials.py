"""How the client proves who it talks to and who it is: TLS, client certificates, a token.

`Security` opens every channel of a client the same way: `grpc.secure_channel` with
`grpc.ssl_channel_credentials` (and the bearer token as call credentials) under TLS; a
plaintext channel with the token added to each call's metadata by an interceptor
otherwise (gRPC refuses call credentials on insecure channels).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# PEM bytes, or the path of a PEM file.
PemSource = bytes | str | os.PathLike[str]


def read_pem(source: PemSource | None) -> bytes | None:
    """The PEM bytes `source` holds or names (a str or path names a file)."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True)
class Security:
    """The credentials of every channel a client opens.

    Attributes:
        tls: use TLS (implied by any certificate or key).
        root_certificates: PEM of the CAs trusted to sign the server's certificate;
            None trusts the system's roots.
        certificate_chain, private_key: PEM of the client's own certificate and key,
            for servers that require them (mutual TLS).
        token: sent with every call as `authorization: Bearer <token>`.
        server_name: the name the server's certificate must hold, where it is not the
            target's host (an ipv4: list of replicas, a certificate for a DNS name).
    """

    tls: bool = False
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None
    server_name: str | None = None

    @classmethod
    def of(
        cls,
        *,
        tls: bool = False,
        root_certificates: PemSource | None = None,
        certificate_chain: PemSource | None = None,
        private_key: PemSource | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ) -> Security:
        """Security from the client's arguments, reading the PEM files they name."""
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together")
        if token is not None and not token.strip():
            raise ValueError("token is empty")
        tls = tls or any(
            pem is not None for pem in (root_certificates, certificate_chain, private_key)
        )
        return cls(
            tls=tls,
            root_certificates=read_pem(root_certificates),
            certificate_chain=read_pem(certificate_chain),
            private_key=read_pem(private_key),
            token=token.strip() if token is not None else None,
            server_name=server_name,
        )

    def open(self, target: str, options: Iterable[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `target` with these credentials."""
        options = list(options)
        if self.tls:
            return grpc.secure_channel(target, self._channel_credentials(), options=options)
        channel = grpc.insecure_channel(target, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _MetadataInterceptor(self._metadata))

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
        if self.token is None:
            return credentials
        token = grpc.access_token_call_credentials(self.token)
        return grpc.composite_channel_credentials(credentials, token)

    def _metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")]


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details with other metadata (gRPC's own class cannot be copied)."""


class _MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the entries `metadata()` returns to every call, of every kind."""

    def __init__(self, metadata: Callable[[], list[tuple[str, str]]]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), *self._metadata()],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
