"""The places calls take: a pool of places of one kind (`Pool`: at most `limit` calls,
refusing or evicting when full), each caller's part of a resource (`Shares`: waiting or
refused past its share), and the workers' permits (`wait_for_permit`). Each place is
given back once, when its call ends; none expires."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

_NO_WORKER = "the call ended while it waited for a worker"
# An open call waiting this long on its client may lose its place to a new one.
EVICTABLE_AFTER_S = 0.5
# How often a call waiting for a worker's permit looks whether it has ended.
PERMIT_POLL_S = 0.5


class Place:
    """One admitted call's place: given back once, when the call ends (or when it is
    evicted); while its call waits on its client it is `waiting` with its context."""

    def __init__(self, places: Pool) -> None:
        self._places = places
        self.since = 0.0

    def waited(self, seconds: float) -> bool:
        return time.monotonic() - self.since >= seconds

    def hold_until_done(self, context: grpc.ServicerContext) -> None:
        """Give the place back when the call ends (at once if it has ended already)."""
        if not context.add_callback(self.give_back):
            self.give_back()

    def waiting(self, context: grpc.ServicerContext | None) -> None:
        """The call waits on its client (`context`), or no longer (None)."""
        self._places.mark_waiting(self, context)

    def give_back(self) -> None:
        self._places.give_back(self)


class Pool:
    """Calls of one kind admitted and not yet ended, at most `limit`. A place is taken as
    the call arrives (gRPC's poll thread) and given back when it ends. gRPC runs the
    handler of every call the guard admits (its own limit lies above the sum of the
    guard's: the `grpc_calls` limit), so no place is lost and none needs to expire.
    With `evict`, a call arriving at the limit takes the place of the one that has waited
    on its client longest, if for EVICTABLE_AFTER_S at least, which is cancelled: callers
    that send nothing cannot lock out those that do, and a call whose request is on its
    way is never cut off by one that arrived just after it."""

    def __init__(self, limit: int, *, evict: bool = False) -> None:
        self.limit = limit
        self._evict = evict
        self._held: set[Place] = set()
        self._waiting: dict[Place, grpc.ServicerContext] = {}  # oldest first
        self._lock = threading.Lock()

    def take(self) -> Place | None:
        evicted = None
        with self._lock:
            if len(self._held) >= self.limit:
                oldest = next(iter(self._waiting), None)
                if not self._evict or oldest is None or not oldest.waited(EVICTABLE_AFTER_S):
                    return None
                evicted = self._waiting.pop(oldest)
                self._held.discard(oldest)
            place = Place(self)
            self._held.add(place)
        if evicted is not None:
            evicted.cancel()
        return place

    def mark_waiting(self, place: Place, context: grpc.ServicerContext | None) -> None:
        with self._lock:
            if context is None:
                self._waiting.pop(place, None)
            elif place in self._held:
                place.since = time.monotonic()
                self._waiting[place] = context

    def give_back(self, place: Place) -> None:
        with self._lock:
            self._held.discard(place)
            self._waiting.pop(place, None)


def take_each(pools: list[Pool]) -> list[Place] | None:
    """A place of each pool, or none at all."""
    taken: list[Place] = []
    for pool in pools:
        place = pool.take()
        if place is None:
            for held in taken:
                held.give_back()
            return None
        taken.append(place)
    return taken


class CallerPools:
    """A pool of `limit` places for each caller (a token: the token file bounds how many
    there are), made at the caller's first call; None for no limit."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._pools: dict[str, Pool] = {}
        self._lock = threading.Lock()

    def of(self, caller: str | None) -> list[Pool]:
        """The caller's pool, or none where there is no limit or no caller yet (without
        tokens, a call arriving has no identity to share by)."""
        if self._limit is None or caller is None:
            return []
        with self._lock:
            if caller not in self._pools:
                self._pools[caller] = Pool(self._limit)
            return [self._pools[caller]]


class Shares:
    """Each caller's share of a resource: at most `limit` of its calls hold it at once, so
    that one caller cannot hold all of it. The workers: a caller's further calls wait,
    holding none (`take`); the open services' places: they are refused (`try_take`).

    A call given back wakes one waiter of the same caller, not every waiter: with 16 calls
    of one caller waiting, waking them all at each end cost 0.4-1.1 ms of CPU a call
    (`benchmarks/server_cpu.py`, admission)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        # A caller's waiting calls: its condition and how many wait on it (gone with the
        # last, so that callers come and go without the table growing).
        self._waiting: dict[str, tuple[threading.Condition, int]] = {}

    def take(self, caller: str, context: grpc.ServicerContext) -> None:
        """Wait for the caller's share, given back when the call ends; a call that ends
        meanwhile waits no longer."""
        with self._lock:
            if self._held.get(caller, 0) >= self.limit:
                self._wait_turn(caller, context)
            self._held[caller] = self._held.get(caller, 0) + 1
        if not context.add_callback(lambda: self._give_back(caller)):
            self._give_back(caller)
            context.abort(grpc.StatusCode.CANCELLED, _NO_WORKER)

    def _wait_turn(self, caller: str, context: grpc.ServicerContext) -> None:
        """(holding the lock) Wait until the caller holds less than its share."""
        turn, count = self._waiting.get(caller, (threading.Condition(self._lock), 0))
        self._waiting[caller] = (turn, count + 1)
        try:
            while self._held.get(caller, 0) >= self.limit:
                turn.wait(PERMIT_POLL_S)
                if not context.is_active():
                    turn.notify()  # the turn it may have been given goes to the next
                    context.abort(grpc.StatusCode.CANCELLED, _NO_WORKER)
        finally:
            turn, count = self._waiting[caller]
            if count > 1:
                self._waiting[caller] = (turn, count - 1)
            else:
                del self._waiting[caller]

    def try_take(self, caller: str) -> Callable[[], None] | None:
        """One of the caller's share at once, or None if it holds all of it: returns the
        function that gives it back (once, however often and from whichever threads it
        is called)."""
        with self._lock:
            if self._held.get(caller, 0) >= self.limit:
                return None
            self._held[caller] = self._held.get(caller, 0) + 1
        once = threading.Lock()

        def give_back() -> None:
            if once.acquire(blocking=False):
                self._give_back(caller)

        return give_back

    def _give_back(self, caller: str) -> None:
        with self._lock:
            left = self._held.get(caller, 0) - 1
            if left > 0:
                self._held[caller] = left
            else:
                self._held.pop(caller, None)
            if caller in self._waiting:
                self._waiting[caller][0].notify()


def wait_for_permit(permits: threading.Semaphore, context: grpc.ServicerContext) -> None:
    """Wait for one of the workers' permits, held until the call ends (FIFO enough: the
    semaphore wakes waiters in turn); a call that ends meanwhile waits no longer."""
    while not permits.acquire(timeout=PERMIT_POLL_S):
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, _NO_WORKER)
    if not context.add_callback(permits.release):
        permits.release()
        context.abort(grpc.StatusCode.CANCELLED, _NO_WORKER)
