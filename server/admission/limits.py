"""The server's bounds, one row each, as the reduction catalogue is for reductions: what
each bounds, where its capacity comes from, a caller's share of it, when a call takes it
and gives it back, and what happens when it is full.

`resolve` gives each bound's capacity for a configuration; the guard, the admission of
bytes and examples, gRPC's own options and the `pergrad_limit` metric read them from
there, and docs/operations.md shows the table `markdown` renders (a test holds it to
this one). A new bound is a row here, the code that enforces it, and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

from pergrad.wire.chunked_requests import MESSAGE_BYTES

if TYPE_CHECKING:
    from pergrad.server.config import Config

# A caller may hold at most 1/CALLER_SHARE of a resource it shares with others.
CALLER_SHARE = 2


def share(capacity: int) -> int:
    """A caller's part of `capacity`: 1/CALLER_SHARE of it, at least one."""
    return max(1, capacity // CALLER_SHARE)


@dataclass(frozen=True)
class Limit:
    name: str  # the `limit` label of the pergrad_limit metric
    bounds: str
    capacity: Callable[[Config], int | float]
    set_by: str  # the flag, or "fixed"
    caller_share: str  # who counts as one caller, and how much of it one may hold
    held: str  # when a call takes it and gives it back
    when_full: str  # refuse, wait, evict or cancel
    status: str  # what a call refused or cut short gets


# Calls to health Check and reflection (no token needed) at once, each on a thread of the
# guard's own pool; of which reflection streams; and health Watch streams, on places and
# a pool of their own (they hold no thread once their request is read).
OPEN_CALLS = 16
OPEN_STREAMS = 2
WATCH_STREAMS = 16
# gRPC's own limit lies this far above the calls the guard admits: refusals, which end at
# once on threads of their own, use it; gRPC refuses none of the guard's.
REFUSALS_ROOM = 64
# A request to health or reflection names a service or a symbol: larger ones are refused
# before they are parsed (8 callers without a token sending 57 MiB health checks made
# honest calls 350x slower: `benchmarks/attacks.py` row 16).
OPEN_REQUEST_BYTES = 4096
# Bytes of requests refused for their content a caller may send in a window.
REFUSED_BYTES = 64 << 20
REFUSED_WINDOW_S = 10.0

_REFUSE = "refuse at once"
_EXHAUSTED = "RESOURCE_EXHAUSTED"
_ARRIVAL_TO_END = "from the call's arrival to its end"
_PER_TOKEN = "half per token (with --auth-token-file)"

LIMITS: tuple[Limit, ...] = (
    Limit(
        "calls",
        "calls to GradientService admitted at once, computing or waiting for a worker",
        lambda c: c.workers + c.max_queued_calls,
        "--workers + --max-queued-calls",
        _PER_TOKEN,
        _ARRIVAL_TO_END,
        _REFUSE,
        _EXHAUSTED,
    ),
    Limit(
        "workers",
        "calls computing at once",
        lambda c: c.workers,
        "--workers",
        "half per caller (token, else connection) for one-request calls",
        "from the request's arrival (a stream's start) to the call's end",
        "wait, holding no worker",
        "CANCELLED if the call ends meanwhile",
    ),
    Limit(
        "streams",
        "request streams open at once (StreamPerExampleGradients, SetWeights)",
        lambda c: c.max_streams,
        "--max-streams",
        _PER_TOKEN,
        _ARRIVAL_TO_END,
        _REFUSE,
        _EXHAUSTED,
    ),
    Limit(
        "inflight_examples",
        "examples computed at once",
        lambda c: c.max_inflight_examples,
        "--max-inflight-examples",
        "none",
        "while the call computes",
        _REFUSE,
        _EXHAUSTED,
    ),
    Limit(
        "inflight_bytes",
        "bytes calls hold at once: requests and results",
        lambda c: c.max_inflight_bytes,
        "--max-inflight-bytes",
        "half per caller (token, else connection) that holds some already",
        "a request's from its arrival, a result's while it is made, to the call's end",
        _REFUSE,
        _EXHAUSTED,
    ),
    Limit(
        "request_bytes",
        "bytes of one request: its message and its chunked tensors' declared bytes",
        lambda c: c.max_request_bytes or 0,
        "--max-request-bytes (auto: 4 MiB + what a served model's request cannot split)",
        "none",
        "one request",
        "refuse: from its first message, before any chunk is read",
        _EXHAUSTED,
    ),
    Limit(
        "message_bytes",
        "bytes of one message a client sends",
        lambda c: min(MESSAGE_BYTES, c.max_request_bytes or MESSAGE_BYTES),
        "fixed: 4 MiB (less where --max-request-bytes is)",
        "none",
        "one message",
        "refuse, by gRPC before Python copies it",
        _EXHAUSTED,
    ),
    Limit(
        "batch",
        "examples of one request",
        lambda c: c.max_batch,
        "--max-batch",
        "none",
        "one request",
        "refuse: a message once parsed, before its tensors are decoded; a chunked request "
        "from its first message",
        _EXHAUSTED,
    ),
    Limit(
        "refused_bytes",
        f"bytes of a caller's requests refused for their content in {REFUSED_WINDOW_S:g} s",
        lambda c: REFUSED_BYTES,
        "fixed",
        "each caller (token, else connection) its own",
        f"a refused request's bytes, for {REFUSED_WINDOW_S:g} s",
        "refuse the caller's calls unread",
        _EXHAUSTED,
    ),
    Limit(
        "stall_s",
        "seconds a call waits on its client (a request, or reading a response)",
        lambda c: c.stall_timeout_s,
        "--stall-timeout",
        "each call its own",
        "while the call waits on its client",
        "cancel",
        "CANCELLED",
    ),
    Limit(
        "open_calls",
        "calls to health Check and reflection at once (no token needed)",
        lambda c: OPEN_CALLS,
        "fixed",
        "half per connection",
        _ARRIVAL_TO_END,
        "evict the call that has waited on its client longest (0.5 s at least), else refuse",
        _EXHAUSTED,
    ),
    Limit(
        "open_connection_calls",
        "calls one connection has open at once to the open services' own port",
        lambda c: share(OPEN_CALLS),
        "fixed: half of open_calls (with --open-services-port)",
        "each connection its own",
        _ARRIVAL_TO_END,
        "hold further calls on the client's side (gRPC's HTTP/2 stream limit)",
        "none: they wait",
    ),
    Limit(
        "open_streams",
        "reflection streams open at once",
        lambda c: OPEN_STREAMS,
        "fixed",
        "none",
        _ARRIVAL_TO_END,
        _REFUSE,
        _EXHAUSTED,
    ),
    Limit(
        "watch_streams",
        "health Watch streams open at once",
        lambda c: WATCH_STREAMS,
        "fixed",
        "none",
        _ARRIVAL_TO_END,
        "evict the stream that has waited on its client longest, else refuse",
        _EXHAUSTED,
    ),
    Limit(
        "open_request_bytes",
        "bytes of one request to health or reflection",
        lambda c: OPEN_REQUEST_BYTES,
        "fixed",
        "none",
        "one message",
        "refuse before it is parsed (by gRPC, with --open-services-port)",
        _EXHAUSTED,
    ),
    Limit(
        "grpc_calls",
        "calls gRPC runs at once: every bound above's calls, plus room for refusals",
        lambda c: c.workers + c.max_queued_calls + OPEN_CALLS + WATCH_STREAMS + REFUSALS_ROOM,
        f"calls + open_calls + watch_streams + {REFUSALS_ROOM}",
        "none",
        _ARRIVAL_TO_END,
        "refuse (gRPC; never reached by a call the guard admits)",
        _EXHAUSTED,
    ),
    Limit(
        "open_grpc_calls",
        "calls gRPC runs at once on the open services' own port",
        lambda c: OPEN_CALLS + WATCH_STREAMS + REFUSALS_ROOM,
        f"open_calls + watch_streams + {REFUSALS_ROOM}",
        "none",
        _ARRIVAL_TO_END,
        "refuse (gRPC; never reached by a call the guard admits)",
        _EXHAUSTED,
    ),
    Limit(
        "connection_age_s",
        "seconds a client connection lasts",
        lambda c: c.max_connection_age_s,
        "--max-connection-age",
        "each connection its own",
        "from the connection's start",
        "close it (GOAWAY) once its calls end: clients reconnect and re-resolve",
        "none",
    ),
)


class Capacities(dict[str, int | float]):
    """Each bound's capacity under one configuration, by name: counts (places, bytes,
    examples) and, for the bounds of time, seconds."""

    def count(self, name: str) -> int:
        value = self[name]
        if not isinstance(value, int):
            raise TypeError(f"limit {name!r} is {value!r}, not a count")
        return value


def resolve(config: Config) -> Capacities:
    """Each bound's capacity under `config` (its --max-request-bytes resolved already)."""
    return Capacities({limit.name: limit.capacity(config) for limit in LIMITS})


_COLUMNS = ("bound", "what it bounds", "set by", "a caller's share", "held", "when full", "status")


def markdown() -> str:
    """The table as docs/operations.md shows it."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + " --- |" * len(_COLUMNS)]
    for limit in LIMITS:
        cells = (f"`{limit.name}`", limit.bounds, *astuple(limit)[3:])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
