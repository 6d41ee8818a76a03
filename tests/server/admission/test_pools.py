"""The one pool primitive (`pools.Pool`): a cap on places and on one caller's, refused or
evicting when full (`take`), or waited for in turn (`wait_for`): each call that ends
lets exactly one waiting call in, another caller never waits behind a capped one, and a
waiting call that ends passes its turn on."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pergrad.server.admission.pools import EVICTABLE_AFTER_S, WAIT_POLL_S, Pool


class _Aborted(Exception):
    pass


class _Call:
    """The little of a ServicerContext a pool uses: whether the call is active, the
    callbacks run when it ends (`end`), cancel, and an abort that raises as gRPC's does."""

    def __init__(self) -> None:
        self.active = True
        self._callbacks: list = []

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback) -> bool:
        if not self.active:
            return False
        self._callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code)

    def end(self) -> None:
        self.active = False
        for callback in self._callbacks:
            callback()

    cancel = end


def _waiting_for(pool: Pool, caller: str | None, call: _Call) -> tuple[threading.Thread, list]:
    """A thread waiting for a place of `pool` for `call`; its outcome lands in the list."""
    outcome: list = []

    def wait() -> None:
        try:
            pool.wait_for(caller, call)
            outcome.append("in")
        except _Aborted:
            outcome.append("aborted")

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, outcome


def _wait_until(condition, timeout: float = WAIT_POLL_S / 2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def _admitted(waiting: list) -> int:
    return sum(outcome == ["in"] for _, outcome in waiting)


def test_take_refuses_past_the_limit_and_a_place_given_back_is_free_again() -> None:
    pool = Pool(2)
    places = [pool.take(), pool.take()]
    assert pool.take() is None
    places[0].give_back()
    places[0].give_back()  # once: a second give back frees nothing more
    assert pool.take() is not None
    assert pool.take() is None


def test_take_refuses_a_caller_past_its_share_and_serves_another() -> None:
    pool = Pool(4, per_caller=2)
    assert pool.take("a") and pool.take("a")
    assert pool.take("a") is None
    assert pool.take("b") is not None
    assert pool.take(None) is not None  # no caller known: counted against none


def test_a_full_evicting_pool_cancels_the_call_idle_longest_and_only_after_a_while() -> None:
    pool = Pool(2, evict=True)
    idle, busy = _Call(), _Call()
    first, _ = pool.take(), pool.take()
    first.waiting(idle)
    assert pool.take() is None  # idle, but not for EVICTABLE_AFTER_S yet
    first.since -= EVICTABLE_AFTER_S
    assert pool.take() is not None
    assert not idle.is_active() and busy.is_active()


def test_a_claim_past_the_callers_share_is_refused_and_given_back_with_the_place() -> None:
    pool = Pool(4, per_caller=1)
    first, second = pool.take(), pool.take()
    assert first.claim("peer")
    assert not second.claim("peer")
    first.give_back()
    assert second.claim("peer")


def test_a_place_claimed_again_counts_once_for_its_latest_caller() -> None:
    pool = Pool(4, per_caller=1)
    place = pool.take("a")
    assert place.claim("a")  # its own caller: counted once
    assert place.claim("b")  # moved: "a" holds none now
    assert pool.take("a") is not None
    assert pool.take("b") is None


def test_calls_past_a_callers_share_wait_and_each_call_that_ends_lets_one_in() -> None:
    pool = Pool(8, per_caller=2)
    holding = [_Call(), _Call()]
    for call in holding:
        pool.wait_for("a", call)
    waiting = [_waiting_for(pool, "a", _Call()) for _ in range(3)]
    time.sleep(0.05)
    assert _admitted(waiting) == 0
    holding[0].end()
    # Woken at once, not at the next poll: one in, the others still waiting.
    assert _wait_until(lambda: _admitted(waiting) == 1)
    time.sleep(0.05)
    assert _admitted(waiting) == 1


def test_calls_past_the_limit_wait_whoever_their_caller() -> None:
    pool = Pool(1, per_caller=1)
    holder = _Call()
    pool.wait_for("a", holder)
    waiting = [_waiting_for(pool, caller, _Call()) for caller in ("b", None)]
    time.sleep(0.05)
    assert _admitted(waiting) == 0
    holder.end()
    assert _wait_until(lambda: _admitted(waiting) == 1)


def test_one_callers_waiting_calls_do_not_hold_up_anothers() -> None:
    pool = Pool(8, per_caller=1)
    pool.wait_for("a", _Call())
    _waiting_for(pool, "a", _Call())
    thread, outcome = _waiting_for(pool, "b", _Call())
    thread.join(timeout=WAIT_POLL_S / 2)
    assert outcome == ["in"]


@pytest.mark.parametrize("ended", [0, 1], ids=["the first waiter ended", "the second"])
def test_a_waiting_call_that_ends_passes_its_turn_to_the_next(ended: int) -> None:
    pool = Pool(8, per_caller=1)
    holder = _Call()
    pool.wait_for("a", holder)
    calls = [_Call(), _Call()]
    waiting = []
    for call in calls:
        waiting.append(_waiting_for(pool, "a", call))
        time.sleep(0.02)  # in this order
    calls[ended].active = False
    holder.end()
    live = 1 - ended
    assert _wait_until(lambda: waiting[live][1] == ["in"])
    assert _wait_until(lambda: waiting[ended][1] == ["aborted"], timeout=2 * WAIT_POLL_S)
