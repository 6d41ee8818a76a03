"""The amounts calls hold, one primitive for every kind (examples and bytes held at once,
a caller's bytes of refused requests over a window): a `Budget` of `capacity` units, a
caller holding some already at most `per_caller` of them (one call may take the whole
budget, many calls of one caller cannot). A call takes its amount or is refused at once
(`take`), and gives it back when it ends. A windowed budget is charged instead (`charge`:
what was spent already, never refused) and lets go of each charge `window_s` after it:
a caller past its share waits until enough has aged out (`wait_s`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pergrad.server.admission.callers import Held
from pergrad.server.admission.limits import REFUSED_BYTES, REFUSED_WINDOW_S
from pergrad.server.errors import RequestTooLarge, ResourceExhausted

# Callers a windowed budget remembers at once: past it, those with nothing in the window
# are forgotten.
MAX_CALLERS = 4096


@dataclass(frozen=True)
class Unit:
    """What a budget counts, and the flag that sets its capacity, for its refusals."""

    what: str  # "examples", "bytes"
    flag: str


class Budget:
    """At most `capacity` units held at once, and `per_caller` by a caller holding some
    already (None: no cap). A windowed one (`window_s`) keeps each caller's charges in
    buckets of a second, so a caller's record stays small however many it sends."""

    def __init__(
        self,
        capacity: int | None,
        unit: Unit,
        *,
        per_caller: int | None = None,
        window_s: float | None = None,
        max_callers: int = MAX_CALLERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity, self.per_caller, self.window_s = capacity, per_caller, window_s
        self._unit = unit
        self._max_callers, self._clock = max_callers, clock
        self._held = 0
        self._by_caller = Held()
        self._charges: dict[str, deque[list[int]]] = {}  # windowed: [second, amount]
        self._lock = threading.Lock()

    def check_alone(self, amount: int, own: int = 0) -> None:
        """Refuse an amount no call could ever hold, whatever others hold: a refusal for
        what the call holds, not a busy server's."""
        if self.capacity is not None and own + amount > self.capacity:
            raise RequestTooLarge(
                f"call needs {own + amount} {self._unit.what} held; this server admits at "
                f"most {self.capacity} ({self._unit.flag}): send smaller batches"
            )

    def take(self, amount: int, caller: str = "", *, own: int = 0) -> Callable[[], None]:
        """Hold `amount` until the returned function is called, or refuse at once: the
        call's `own` units, held already, are not another call's."""
        self.check_alone(amount, own)
        unit = self._unit
        with self._lock:
            mine = self._by_caller[caller]
            if self.per_caller is not None and mine > own and mine + amount > self.per_caller:
                raise ResourceExhausted(
                    f"this caller's calls hold {mine} {unit.what}, and with {amount} more "
                    f"would hold over half of {unit.flag} ({self.per_caller}): wait for "
                    "them to end"
                )
            if self.capacity is not None and self._held + amount > self.capacity:
                raise ResourceExhausted(
                    f"server busy: calls hold {self._held} of {self.capacity} {unit.what} "
                    f"({unit.flag}); retry later or on another replica"
                )
            self._add(caller, amount)
        return lambda: self._give(caller, amount)

    def charge(self, caller: str, amount: int) -> None:
        """Count `amount` against `caller` for the window (windowed budgets)."""
        now = self._clock()
        with self._lock:
            charges = self._charges.get(caller)
            if charges is None:
                self._forget_idle(now)
                charges = self._charges[caller] = deque()
            if charges and charges[-1][0] == int(now):
                charges[-1][1] += amount
            else:
                charges.append([int(now), amount])
            self._add(caller, amount)
            self._expire(caller, now)

    def wait_s(self, caller: str) -> float:
        """Seconds until the caller's charges in the window are within its share again
        (0: they are)."""
        if caller not in self._charges:  # most callers: no lock taken on their calls
            return 0.0
        now = self._clock()
        with self._lock:
            self._expire(caller, now)
            total, wait = self._by_caller[caller], 0.0
            for second, amount in self._charges.get(caller, ()):  # the oldest first
                if self.per_caller is None or total <= self.per_caller:
                    break
                total -= amount
                wait = second + 1 + (self.window_s or 0.0) - now
            return max(0.0, wait)

    def _add(self, caller: str, amount: int) -> None:
        self._held += amount
        self._by_caller.add(caller, amount)

    def _give(self, caller: str, amount: int) -> None:
        with self._lock:
            self._give_locked(caller, amount)

    def _give_locked(self, caller: str, amount: int) -> None:
        self._held -= amount
        self._by_caller.remove(caller, amount)

    def _expire(self, caller: str, now: float) -> None:
        """(holding the lock) Let go of the caller's charges older than the window."""
        charges = self._charges.get(caller)
        if charges is None:
            return
        while charges and charges[0][0] + 1 + (self.window_s or 0.0) <= now:
            self._give_locked(caller, charges.popleft()[1])
        if not charges:
            del self._charges[caller]

    def _forget_idle(self, now: float) -> None:
        """(holding the lock) Room for one more caller: those with nothing in the window
        go first, then the oldest."""
        if len(self._charges) < self._max_callers:
            return
        for caller in list(self._charges):
            self._expire(caller, now)
        while len(self._charges) >= self._max_callers:
            oldest = next(iter(self._charges))
            del self._charges[oldest]
            self._give_locked(oldest, self._by_caller[oldest])


def refused_bytes() -> Budget:
    """A caller's bytes of requests refused for what they held (the `refused_bytes`
    limit): each was received and copied before it could be refused, so a caller past
    its share has its calls refused unread until enough has aged out."""
    unit = Unit("bytes", "refused_bytes")
    return Budget(None, unit, per_caller=REFUSED_BYTES, window_s=REFUSED_WINDOW_S)
