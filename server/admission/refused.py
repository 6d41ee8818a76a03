"""A caller's refused bytes: requests refused for what they held (malformed, naming what
is not served, over a bound on one request: `calls.Call.refused_for_content`), over a
sliding window. Each was received and copied before it could be
refused, so a caller sending large ones in a loop makes the server copy for nothing;
past its budget, its calls are refused before their request is read."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from pergrad.server.admission.limits import REFUSED_BYTES, REFUSED_WINDOW_S

# Callers remembered at once: past it, those with nothing in the window are forgotten.
MAX_CALLERS = 4096


class RefusedBytes:
    """Per caller, the bytes of its refused requests in the last `window_s`, in buckets
    of a second (so a caller's record stays small however many it sends)."""

    def __init__(
        self,
        budget: int = REFUSED_BYTES,
        window_s: float = REFUSED_WINDOW_S,
        *,
        max_callers: int = MAX_CALLERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget, self.window_s = budget, window_s
        self._max_callers = max_callers
        self._clock = clock
        self._lock = threading.Lock()
        self._callers: dict[str, deque[list[float]]] = {}

    def add(self, caller: str, nbytes: int) -> None:
        now = self._clock()
        with self._lock:
            buckets = self._callers.get(caller)
            if buckets is None:
                self._forget_idle(now)
                buckets = self._callers[caller] = deque()
            second = float(int(now))
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += nbytes
            else:
                buckets.append([second, float(nbytes)])
            self._expire(buckets, now)

    def wait_s(self, caller: str) -> float:
        """Seconds until the caller's refused bytes in the window are within the budget
        again (0: they are)."""
        if caller not in self._callers:  # most callers: no lock taken on their calls
            return 0.0
        now = self._clock()
        with self._lock:
            buckets = self._callers.get(caller)
            if not buckets:
                return 0.0
            self._expire(buckets, now)
            total, wait = sum(b[1] for b in buckets), 0.0
            for second, nbytes in buckets:  # the oldest first, until the rest fit
                if total <= self.budget:
                    break
                total -= nbytes
                wait = second + 1 + self.window_s - now
            return max(0.0, wait)

    def _expire(self, buckets: deque[list[float]], now: float) -> None:
        while buckets and buckets[0][0] + 1 + self.window_s <= now:
            buckets.popleft()

    def _forget_idle(self, now: float) -> None:
        if len(self._callers) < self._max_callers:
            return
        for caller in list(self._callers):
            self._expire(self._callers[caller], now)
            if not self._callers[caller]:
                del self._callers[caller]
        while len(self._callers) >= self._max_callers:  # all active: the oldest goes
            del self._callers[next(iter(self._callers))]
