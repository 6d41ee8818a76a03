"""Bearer-token authentication: a gRPC server interceptor and the token file it reads.

The token file holds one token per line; `token:ro` marks a read-only token, which may
call every method but SetWeights and ApplyStep (those that change weights). Blank lines
and lines starting with `#` are skipped.
A call presents its token as metadata `authorization: Bearer <token>`; a missing or
unknown token ends it with UNAUTHENTICATED, a read-only token calling either with
PERMISSION_DENIED. Health and reflection stay open, so probes need no token. A refused
call ends at once, before its request is read or its handler looked up, on the threads
kept for refusals (`handlers.refusal`): it waits behind no busy worker and holds no worker,
no place in the queue and no stream's place (`guard`).

Tokens are compared as SHA-256 digests with `hmac.compare_digest`, every known token
each time, so the time a check takes tells nothing about which bytes matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pergrad.server.transport.handlers import refusal
from pergrad.wire.rpc import OPEN_SERVICES, method_path, split_method, streaming

READ_ONLY_SUFFIX = ":ro"
# Methods that change the server's state: read-write tokens only.
WRITE_METHODS = frozenset({method_path("SetWeights"), method_path("ApplyStep")})


class TokenFileError(ValueError):
    """A token file the server cannot use."""


@dataclass(frozen=True)
class Tokens:
    """Digests of the accepted tokens, each with whether it may only read."""

    read_only_by_digest: Mapping[bytes, bool]

    def lookup(self, token: str) -> bool | None:
        """None for an unknown token, else whether it is read-only (in constant time)."""
        presented = _digest(token)
        found: bool | None = None
        for digest, read_only in self.read_only_by_digest.items():
            if hmac.compare_digest(presented, digest):
                found = read_only
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str) -> Tokens:
    """The tokens of a token file's text; TokenFileError names the line at fault."""
    tokens: dict[bytes, bool] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        read_only = line.endswith(READ_ONLY_SUFFIX)
        token = line.removesuffix(READ_ONLY_SUFFIX) if read_only else line
        if not token or any(c.isspace() for c in token):
            raise TokenFileError(f"line {number}: a token is one word, optionally with ':ro'")
        digest = _digest(token)
        if tokens.get(digest, read_only) != read_only:
            raise TokenFileError(f"line {number}: token listed both read-only and read-write")
        tokens[digest] = read_only
    if not tokens:
        raise TokenFileError("holds no tokens")
    return Tokens(tokens)


def load_tokens(path: Path) -> Tokens:
    """The tokens of the file at `path` (OSError if unreadable, TokenFileError if unusable)."""
    return parse_tokens(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is no token


def bearer_token(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, if the call sent one."""
    for key, value in metadata or ():
        if key.lower() != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def token_key(metadata: Any) -> str:
    """The key a caller on a server with tokens is counted under: its token's digest
    (none presented: the empty token's; the token check refuses such calls before)."""
    return _digest(bearer_token(metadata) or "").hex()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with a known bearer token (any call to an open service)."""

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if split_method(method)[0] in OPEN_SERVICES:
            return continuation(handler_call_details)
        refused = self._refusal(method, handler_call_details.invocation_metadata)
        if refused is None:
            return continuation(handler_call_details)
        declared = streaming(method)
        if declared is not None:
            # Refused before its handler is looked up: nothing behind this interceptor (the
            # guard, which admits streams as they arrive) sees the call.
            return refusal(declared[1], *refused)
        handler = continuation(handler_call_details)  # a method with no descriptor, or none
        return None if handler is None else refusal(handler.response_streaming, *refused)

    def _refusal(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """The status a call gets instead of an answer, or None to let it through."""
        token = bearer_token(metadata)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization)"
        read_only = self._tokens.lookup(token)
        if read_only is None:
            return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"
        if read_only and method in WRITE_METHODS:
            name = split_method(method)[1]
            return grpc.StatusCode.PERMISSION_DENIED, f"a read-only token cannot call {name}"
        return None
