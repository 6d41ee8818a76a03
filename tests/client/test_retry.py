"""client/_retry.py: a call sent again while its server is unavailable, within the call's
one deadline, with the backoff its constants give."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError, _retry
from pergrad.client._retry import MAX_BACKOFF_S, backoff_s, retried
from tests.pauses import gated_server

MODEL = "gated"


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Sends:
    """A send failing with `code` `failures` times, then answering; the time left each
    attempt was given."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code = failures, code
        self.given: list[float | None] = []

    def __call__(self, left: float | None) -> str:
        self.given.append(left)
        if len(self.given) <= self.failures:
            raise _Failed(self.code)
        return "answered"


class _Clock:
    """`_retry`'s time: a sleep takes `overshoot` times what it asks, at no cost."""

    def __init__(self, overshoot: float = 1.0) -> None:
        self.now, self.overshoot = 1000.0, overshoot

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds * self.overshoot


def _clocked(monkeypatch: pytest.MonkeyPatch, overshoot: float = 1.0) -> _Clock:
    clock = _Clock(overshoot)
    monkeypatch.setattr(_retry, "time", clock)
    return clock


def test_each_retry_is_given_what_is_left_of_one_deadline(monkeypatch) -> None:
    clock = _clocked(monkeypatch)
    sends = _Sends(failures=2)
    assert retried(sends, retries=5, deadline=clock.now + 30.0) == "answered"
    after_one, after_two = 30.0 - backoff_s(0), 30.0 - backoff_s(0) - backoff_s(1)
    assert sends.given == pytest.approx([30.0, after_one, after_two])


def test_no_retry_is_made_whose_backoff_would_end_past_the_deadline(monkeypatch) -> None:
    """The second backoff would end past the deadline: the second failure is raised,
    whatever retries remain."""
    clock = _clocked(monkeypatch)
    timeout = backoff_s(0) + backoff_s(1) / 2
    sends = _Sends(failures=10)
    with pytest.raises(grpc.RpcError) as failed:
        retried(sends, retries=10, deadline=clock.now + timeout)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sends.given == pytest.approx([timeout, timeout - backoff_s(0)])


def test_no_retry_is_made_once_a_backoff_overran_the_deadline(monkeypatch) -> None:
    """A sleep longer than asked (a busy machine) leaves no time: the failure is raised,
    not an attempt with none left (gRPC's DEADLINE_EXCEEDED in place of UNAVAILABLE)."""
    clock = _clocked(monkeypatch, overshoot=10.0)
    sends = _Sends(failures=10)
    with pytest.raises(grpc.RpcError) as failed:
        retried(sends, retries=10, deadline=clock.now + 3 * backoff_s(0))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(sends.given) == 1


def test_without_a_timeout_every_retry_is_made(monkeypatch) -> None:
    _clocked(monkeypatch)
    sends = _Sends(failures=10)
    with pytest.raises(grpc.RpcError):
        retried(sends, retries=2, deadline=None)
    assert sends.given == [None, None, None]


def test_a_status_other_than_unavailable_is_not_retried(monkeypatch) -> None:
    clock = _clocked(monkeypatch)
    sends = _Sends(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as failed:
        retried(sends, retries=5, deadline=clock.now + 30.0)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(sends.given) == 1


def test_a_call_whose_server_is_gone_ends_within_its_timeout(servers) -> None:
    """Thirty retries' backoffs come to ~27.5 s: a call given 1 s fails with UNAVAILABLE
    long before (the slack is for a busy machine), as gRPC's own retries would."""
    servers.append(running := gated_server()[1])
    x, y = np.zeros((8, 4), np.float32), np.arange(8) % 3
    with GradientClient(f"127.0.0.1:{running.port}", timeout=1.0, retries=30) as client:
        client.model_info(MODEL)  # known before its server goes
        running.stop(0)
        started = time.monotonic()
        with pytest.raises(PergradError) as failed:
            client.per_example_gradients(MODEL, x, y)
        elapsed = time.monotonic() - started
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert elapsed < 1.0 + 10 * MAX_BACKOFF_S
