"""A caller's refused bytes over a sliding window (`RefusedBytes`), on a clock of the
test's own."""

from __future__ import annotations

import pytest

from pergrad.server.admission.refused import RefusedBytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


def test_a_caller_within_its_budget_waits_for_nothing(clock: Clock) -> None:
    refused = RefusedBytes(100, 10.0, clock=clock)
    refused.add("a", 60)
    refused.add("a", 40)
    assert refused.wait_s("a") == 0


def test_a_caller_over_its_budget_waits_until_enough_has_aged_out(clock: Clock) -> None:
    refused = RefusedBytes(100, 10.0, clock=clock)
    refused.add("a", 60)
    clock.now += 3
    refused.add("a", 60)
    assert refused.wait_s("a") == pytest.approx(8.0)  # the first second's bucket, 1 + 10 - 3
    clock.now += 8
    assert refused.wait_s("a") == 0


def test_a_caller_told_to_wait_is_refused_for_exactly_that_long(clock: Clock) -> None:
    """The wait a refusal names is the truth, second by second: a caller told to wait 8 s
    is still over its budget 7.9 s later, and within it at 8 s (before: its oldest
    second expired a second early, letting it in after 7)."""
    refused = RefusedBytes(100, 10.0, clock=clock)
    refused.add("a", 60)
    clock.now += 3
    refused.add("a", 60)
    told, start = refused.wait_s("a"), clock.now
    assert told == pytest.approx(8.0)
    for waited in (1.0, 6.5, 7.0, 7.9):
        clock.now = start + waited
        assert refused.wait_s("a") == pytest.approx(told - waited)
    clock.now = start + told
    assert refused.wait_s("a") == 0


def test_callers_are_counted_apart(clock: Clock) -> None:
    refused = RefusedBytes(100, 10.0, clock=clock)
    refused.add("a", 500)
    assert refused.wait_s("a") > 0
    assert refused.wait_s("b") == 0


def test_many_refusals_in_one_second_keep_one_bucket(clock: Clock) -> None:
    refused = RefusedBytes(10**9, 10.0, clock=clock)
    for _ in range(10_000):
        refused.add("a", 1)
    assert len(refused._callers["a"]) == 1


def test_callers_past_the_bound_forget_those_idle_first(clock: Clock) -> None:
    """The idle caller is the newer one: dropping the oldest would drop the active one."""
    refused = RefusedBytes(100, 10.0, max_callers=2, clock=clock)
    refused.add("active", 500)
    refused.add("idle", 500)
    clock.now += 5
    refused.add("active", 500)
    clock.now += 8
    refused.add("new", 500)
    assert set(refused._callers) == {"active", "new"}
    assert refused.wait_s("active") > 0
