"""What the server reads and sets of grpcio's sync server that grpcio does not publish, in
one place, and why (grpcio 1.85; the tests of `transport/` fail if a release drops one).

- A handler's behaviour marked `experimental_non_blocking` is called with a `send`
  callback and gives its thread back at once: a health Watch stream would otherwise hold
  a worker for as long as its client keeps it open (an idle Watch is how a caller with no
  token could hold every thread).
- A behaviour's `experimental_thread_pool` runs its calls on that pool rather than the
  server's: refusals end at once on threads of their own, never queued behind workers
  busy computing, and health and reflection run on the open services' own pool.
- `ServicerContext.code()` (documented, but as experimental, and missing from grpcio's
  type stubs): the status a handler set, for the metrics of a call's end.
- A client that cancels its request stream looks to the handler like one that closed
  its side; only the call's state (`context._state.client == "cancelled"`) tells them
  apart, with no public accessor.

gRPC's Python server offers no other way to do any of these.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import grpc

_NON_BLOCKING = "experimental_non_blocking"
_THREAD_POOL = "experimental_thread_pool"


def non_blocking(behavior: Callable[..., Any]) -> None:
    """Mark `behavior` to be called with a `send` callback."""
    behavior.__dict__[_NON_BLOCKING] = True


def is_non_blocking(behavior: Callable[..., Any]) -> bool:
    return bool(getattr(behavior, _NON_BLOCKING, False))


def run_on(behavior: Callable[..., Any], pool: Executor) -> None:
    """Run `behavior`'s calls on `pool` instead of the server's threads."""
    behavior.__dict__[_THREAD_POOL] = pool


def pool_of(behavior: Callable[..., Any]) -> Executor | None:
    """The pool `behavior` runs on, if not the server's."""
    return getattr(behavior, _THREAD_POOL, None)


def code_set(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """The status code the handler set on `context`, if any."""
    return context.code()  # type: ignore[attr-defined]


def cancelled_by_client(context: grpc.ServicerContext) -> bool:
    """Whether a call that has ended was cancelled by its client."""
    return getattr(getattr(context, "_state", None), "client", None) == "cancelled"
