"""A call sent again while its server is unavailable, for the calls the channel's retry
policy cannot cover: those that stream their request (grpc/grpc#41036), retried with the
policy's own backoff."""

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


def retried(send: Callable[[], T], retries: int) -> T:
    """send(), sent again up to `retries` times while it fails with a RETRYABLE status;
    any other error, or the last one, is raised as it is."""
    for attempt in range(retries):
        try:
            return send()
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE:
                raise
        time.sleep(backoff_s(attempt))
    return send()
