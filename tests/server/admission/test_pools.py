"""A caller's share of the workers (`pools.Shares`): calls past it wait, each call that
ends lets exactly one of the same caller's in, and a waiting call that ends passes its
turn on."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pergrad.server.admission.pools import PERMIT_POLL_S, Shares


class _Aborted(Exception):
    pass


class _Call:
    """The little of a ServicerContext a share uses: whether the call is active, the
    callbacks run when it ends (`end`), and an abort that raises as gRPC's does."""

    def __init__(self) -> None:
        self.active = True
        self._callbacks: list = []

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code)

    def end(self) -> None:
        self.active = False
        for callback in self._callbacks:
            callback()


def _taking(shares: Shares, caller: str, call: _Call) -> tuple[threading.Thread, list]:
    """A thread taking `caller`'s share for `call`; its outcome lands in the list."""
    outcome: list = []

    def take() -> None:
        try:
            shares.take(caller, call)
            outcome.append("in")
        except _Aborted:
            outcome.append("aborted")

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, outcome


def _wait_until(condition, timeout: float = PERMIT_POLL_S / 2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def test_calls_past_a_callers_share_wait_and_each_call_that_ends_lets_one_in() -> None:
    shares = Shares(2)
    holding = [_Call(), _Call()]
    for call in holding:
        shares.take("a", call)
    waiting = [_taking(shares, "a", _Call()) for _ in range(3)]
    time.sleep(0.05)
    assert [outcome for _, outcome in waiting] == [[], [], []]
    holding[0].end()
    # Woken at once, not at the next poll: one in, the others still waiting.
    assert _wait_until(lambda: sum(len(outcome) for _, outcome in waiting) == 1)
    time.sleep(0.05)
    assert sum(len(outcome) for _, outcome in waiting) == 1


def test_one_callers_waiting_calls_do_not_hold_up_anothers() -> None:
    shares = Shares(1)
    shares.take("a", _Call())
    _taking(shares, "a", _Call())
    thread, outcome = _taking(shares, "b", _Call())
    thread.join(timeout=PERMIT_POLL_S / 2)
    assert outcome == ["in"]


@pytest.mark.parametrize("ended", [0, 1], ids=["the first waiter ended", "the second"])
def test_a_waiting_call_that_ends_passes_its_turn_to_the_next(ended: int) -> None:
    shares = Shares(1)
    holder = _Call()
    shares.take("a", holder)
    calls = [_Call(), _Call()]
    waiting = []
    for call in calls:
        waiting.append(_taking(shares, "a", call))
        time.sleep(0.02)  # in this order
    calls[ended].active = False
    holder.end()
    live = 1 - ended
    assert _wait_until(lambda: waiting[live][1] == ["in"])
    assert _wait_until(lambda: waiting[ended][1] == ["aborted"], timeout=2 * PERMIT_POLL_S)
