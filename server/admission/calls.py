"""One record per call, made as the guard admits it: whom it is counted for (one key,
worked out once: its token's, else its connection's once the handler knows it), its
request's bytes as they were read (its deserializer records them: `reading`), and
whether it was refused for what its request held. The guard hands the servicer the
call's context with its record on it (`Context`); the servicer reads the caller and the
bytes from it, and `status` marks a refusal for content on it, which the guard then
charges against the caller's refused-bytes budget (`budgets.refused_bytes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass
class Call:
    caller: str  # its token's digest where the server has tokens, else its connection
    request_bytes: int = 0  # the latest request's size on the wire; 0: none read yet
    held_bytes: int = 0  # what the guard holds for its one request, from its arrival
    refused_for_content: bool = False  # malformed, naming what is not served, too large

    def reading(self, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
        """`parse` (None: the bytes themselves), keeping each message's size on the record
        as it is read (a stream's latest: a stream's refusal is its latest request's)."""

        def parse_recorded(data: bytes) -> Any:
            self.request_bytes = len(data)
            return parse(data) if parse else data

        return parse_recorded


class Context:
    """gRPC's context of a call, carrying the call's record (`record`): everything else
    is gRPC's own."""

    def __init__(self, context: grpc.ServicerContext, record: Call) -> None:
        self._context, self.record = context, record

    def __getattr__(self, name: str) -> Any:
        if name == "_context":  # not yet set (a copy being made): not gRPC's to answer
            raise AttributeError(name)
        return getattr(self._context, name)


def of(context: grpc.ServicerContext | Context) -> Call:
    """The call's record (a blank one, no caller known, for a call no guard started: a
    servicer driven in-process by a test)."""
    return context.record if isinstance(context, Context) else Call("")
