"""Calls to health and reflection, which need no token (`wire.rpc.OPEN_SERVICES`): how
their requests are parsed, and how a full server refuses a call. A request to an open
service over OPEN_REQUEST_BYTES is refused before it is parsed (RESOURCE_EXHAUSTED): gRPC
has copied it into Python by then, unless the open services have a server of their own
(`--open-services-port`), whose C core refuses it first; one that does not parse is
INVALID_ARGUMENT (gRPC's own answer is INTERNAL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from pergrad.server.admission.limits import OPEN_REQUEST_BYTES
from pergrad.server.errors import InvalidArgument, ResourceExhausted
from pergrad.server.status import RefusedRequest


def open_parser(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """An open service's deserializer (None: the bytes themselves): a request over
    OPEN_REQUEST_BYTES is not parsed, and one that does not parse is INVALID_ARGUMENT
    (gRPC would answer INTERNAL)."""

    def parse_checked(data: bytes) -> Any:
        if len(data) > OPEN_REQUEST_BYTES:
            return RefusedRequest(
                ResourceExhausted(
                    f"a request of {len(data)} bytes; health and reflection take "
                    f"{OPEN_REQUEST_BYTES} at most"
                )
            )
        try:
            return parse(data) if parse else data
        except DecodeError as err:
            return RefusedRequest(InvalidArgument(f"not a valid request: {err}"))

    return parse_checked


def full(open_service: bool) -> str:
    """What a call refused for want of a place is told."""
    what = "calls to health and reflection" if open_service else "such calls"
    return f"this server has as many {what} as it admits at once; retry later or on another replica"
