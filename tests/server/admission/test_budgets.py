"""A windowed budget (a caller's refused bytes over a sliding window), on a clock of the
test's own; `test_inflight` holds a budget taken and given back."""

from __future__ import annotations

import pytest

from pergrad.server.admission.budgets import Budget, Unit, refused_bytes
from pergrad.server.admission.limits import REFUSED_BYTES, REFUSED_WINDOW_S, resolve
from pergrad.server.config import Config


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


def windowed(budget: int, window_s: float, clock: Clock, max_callers: int = 4096) -> Budget:
    """A caller's `budget` bytes over `window_s`, as the guard keeps its refused bytes."""
    unit = Unit("bytes", "refused_bytes")
    return Budget(
        None, unit, per_caller=budget, window_s=window_s, max_callers=max_callers, clock=clock
    )


def test_a_caller_within_its_budget_waits_for_nothing(clock: Clock) -> None:
    refused = windowed(100, 10.0, clock)
    refused.charge("a", 60)
    refused.charge("a", 40)
    assert refused.wait_s("a") == 0


def test_a_caller_over_its_budget_waits_until_enough_has_aged_out(clock: Clock) -> None:
    refused = windowed(100, 10.0, clock)
    refused.charge("a", 60)
    clock.now += 3
    refused.charge("a", 60)
    assert refused.wait_s("a") == pytest.approx(8.0)  # the first second's bucket, 1 + 10 - 3
    clock.now += 8
    assert refused.wait_s("a") == 0


def test_a_caller_told_to_wait_is_refused_for_exactly_that_long(clock: Clock) -> None:
    """The wait a refusal names is the truth, second by second: a caller told to wait 8 s
    is still over its budget 7.9 s later, and within it at 8 s (before: its oldest
    second expired a second early, letting it in after 7)."""
    refused = windowed(100, 10.0, clock)
    refused.charge("a", 60)
    clock.now += 3
    refused.charge("a", 60)
    told, start = refused.wait_s("a"), clock.now
    assert told == pytest.approx(8.0)
    for waited in (1.0, 6.5, 7.0, 7.9):
        clock.now = start + waited
        assert refused.wait_s("a") == pytest.approx(told - waited)
    clock.now = start + told
    assert refused.wait_s("a") == 0


def test_callers_are_counted_apart(clock: Clock) -> None:
    refused = windowed(100, 10.0, clock)
    refused.charge("a", 500)
    assert refused.wait_s("a") > 0
    assert refused.wait_s("b") == 0


def test_many_refusals_in_one_second_keep_one_bucket(clock: Clock) -> None:
    refused = windowed(10**9, 10.0, clock)
    for _ in range(10_000):
        refused.charge("a", 1)
    assert len(refused._charges["a"]) == 1


def test_callers_past_the_bound_forget_those_idle_first(clock: Clock) -> None:
    """The idle caller is the newer one: dropping the oldest would drop the active one."""
    refused = windowed(100, 10.0, clock, max_callers=2)
    refused.charge("active", 500)
    refused.charge("idle", 500)
    clock.now += 5
    refused.charge("active", 500)
    clock.now += 8
    refused.charge("new", 500)
    assert set(refused._charges) == {"active", "new"}
    assert refused.wait_s("active") > 0


def test_a_windowed_caller_forgotten_gives_back_what_it_held(clock: Clock) -> None:
    """A caller dropped to make room holds nothing more: it is not barred if it comes back."""
    refused = windowed(100, 10.0, clock, max_callers=1)
    refused.charge("old", 500)
    refused.charge("new", 1)
    assert refused.wait_s("old") == 0
    refused.charge("old", 1)
    assert refused.wait_s("old") == 0


def test_the_guards_budget_is_the_limits_tables_row() -> None:
    """The refused-bytes budget the guard keeps is the `refused_bytes` row's capacity."""
    budget = refused_bytes()
    assert budget.per_caller == resolve(Config())["refused_bytes"] == REFUSED_BYTES
    assert budget.window_s == REFUSED_WINDOW_S
