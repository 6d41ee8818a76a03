"""A call sent again while its server is unavailable, for the calls the channel's retry
policy cannot cover: those that stream their request (grpc/grpc#41036), retried with the
policy's own backoff and, as gRPC's retries do, within the call's one deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

# A replica that is gone (stopped, restarting, dead mid-call) answers UNAVAILABLE.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# The backoff before each retry: the first, its growth per retry, its cap (seconds).
FIRST_BACKOFF_S, BACKOFF_GROWTH, MAX_BACKOFF_S = 0.1, 2, 1.0

T = TypeVar("T")


def backoff_s(attempt: int) -> float:
    """How long to wait before retry `attempt` + 1."""
    return min(FIRST_BACKOFF_S * BACKOFF_GROWTH**attempt, MAX_BACKOFF_S)


def time_left(deadline: float | None) -> float | None:
    """The seconds left before `deadline` (a `time.monotonic()`; None: there is none)."""
    return None if deadline is None else deadline - time.monotonic()


def retried(send: Callable[[float | None], T], retries: int, deadline: float | None) -> T:
    """send(the seconds left), sent again up to `retries` times while it fails with a
    RETRYABLE status. The attempts and their backoffs share `deadline`: a retry whose
    backoff would end past it is not made. Any other error, or the last one, is raised
    as it is."""
    for attempt in range(retries):
        try:
            return send(time_left(deadline))
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE or not _waited(backoff_s(attempt), deadline):
                raise
    return send(time_left(deadline))


def _waited(wait_s: float, deadline: float | None) -> bool:
    """Sleep `wait_s` and say whether time is left after it; False at once, without
    sleeping, where it would end past `deadline`."""
    if deadline is not None and time.monotonic() + wait_s >= deadline:
        return False
    time.sleep(wait_s)
    return deadline is None or time.monotonic() < deadline
