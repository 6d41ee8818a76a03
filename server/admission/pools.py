"""The places calls take, one primitive for every kind (calls, streams, workers, the open
services' calls and health Watches): a `Pool` of `limit` places, a caller holding at most
`per_caller` of them. A call takes a place as it arrives, refused (or evicting an idle
call) when the pool is full (`take`), or once its request has arrived, waiting its turn
(`wait_for`); it gives it back once, when it ends. None expires."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from pergrad.server.admission.callers import Held

_ENDED_WAITING = "the call ended while it waited for a worker"
# An open call waiting this long on its client may lose its place to a new one.
EVICTABLE_AFTER_S = 0.5
# How often a call waiting for a place looks whether it has ended.
WAIT_POLL_S = 0.5


class Place:
    """One call's place: given back once, when the call ends (or when it is evicted);
    while its call waits on its client it is `waiting`, with its context."""

    def __init__(self, pool: Pool, caller: str | None) -> None:
        self._pool, self.caller = pool, caller
        self.since = 0.0

    def waited(self, seconds: float) -> bool:
        return time.monotonic() - self.since >= seconds

    def hold_until_done(self, context: grpc.ServicerContext) -> None:
        """Give the place back when the call ends (at once if it has ended already)."""
        if not context.add_callback(self.give_back):
            self.give_back()

    def claim(self, caller: str) -> bool:
        """Count the place against `caller` (known only once its call runs: a connection),
        unless that caller holds its share of the pool already."""
        return self._pool.claim(self, caller)

    def waiting(self, context: grpc.ServicerContext | None) -> None:
        """The call waits on its client (`context`), or no longer (None)."""
        self._pool.mark_waiting(self, context)

    def give_back(self) -> None:
        self._pool.give_back(self)


@dataclass(eq=False)
class _Turn:
    """A call waiting for a place: the place is handed to it, counted already."""

    caller: str | None
    ready: threading.Condition
    place: Place | None = None


class Pool:
    """At most `limit` places held at once, and `per_caller` by one caller (None: no cap;
    a place taken with no caller counts against none). gRPC runs the handler of every call
    the guard admits (its own limit lies above the sum of the guard's: the `grpc_calls`
    limit), so no place is lost and none needs to expire.

    When full, `take` refuses; with `evict`, a call arriving takes the place of the one
    that has waited on its client longest, if for EVICTABLE_AFTER_S at least, which is
    cancelled: callers that send nothing cannot lock out those that do, and a call whose
    request is on its way is never cut off by one that arrived just after it.
    `wait_for` waits instead, in arrival order: a place given back goes to the first
    waiting call it fits, and wakes that one alone (waking every waiter at each end cost
    0.4-1.1 ms of CPU a call with 16 waiting: `benchmarks/server_cpu.py`)."""

    def __init__(self, limit: int, *, per_caller: int | None = None, evict: bool = False) -> None:
        self.limit, self.per_caller = limit, per_caller
        self._evict = evict
        self._held: set[Place] = set()
        self._by_caller = Held()
        self._waiting: dict[Place, grpc.ServicerContext] = {}  # on their clients, oldest first
        self._turns: deque[_Turn] = deque()  # calls waiting for a place, oldest first
        self._lock = threading.Lock()

    def take(self, caller: str | None = None) -> Place | None:
        """A place at once, or None (refused)."""
        evicted = None
        with self._lock:
            if not self._caller_fits(caller):
                return None
            if len(self._held) >= self.limit:
                oldest = next(iter(self._waiting), None)
                if not self._evict or oldest is None or not oldest.waited(EVICTABLE_AFTER_S):
                    return None
                evicted = self._waiting.pop(oldest)
                self._remove(oldest)
            place = self._add(caller)
        if evicted is not None:
            evicted.cancel()
        return place

    def wait_for(self, caller: str | None, context: grpc.ServicerContext) -> None:
        """A place held until the call ends, once it is the call's turn; a call that ends
        while it waits gets CANCELLED."""
        with self._lock:
            place = self._add(caller) if self._fits(caller) else self._turn(caller, context)
        if not context.add_callback(place.give_back):
            place.give_back()
            context.abort(grpc.StatusCode.CANCELLED, _ENDED_WAITING)

    def _turn(self, caller: str | None, context: grpc.ServicerContext) -> Place:
        """(holding the lock) Wait until a place is handed to this call."""
        turn = _Turn(caller, threading.Condition(self._lock))
        self._turns.append(turn)
        while turn.place is None:
            turn.ready.wait(WAIT_POLL_S)
            if turn.place is None and not context.is_active():
                self._turns.remove(turn)
                context.abort(grpc.StatusCode.CANCELLED, _ENDED_WAITING)
        return turn.place

    def claim(self, place: Place, caller: str) -> bool:
        with self._lock:
            if place not in self._held:
                return True  # evicted: its call is cancelled, and counts for no one
            if place.caller == caller:
                return True
            if not self._caller_fits(caller):
                return False
            if place.caller is not None:
                self._by_caller.remove(place.caller)
            place.caller = caller
            self._by_caller.add(caller)
            return True

    def mark_waiting(self, place: Place, context: grpc.ServicerContext | None) -> None:
        with self._lock:
            if context is None:
                self._waiting.pop(place, None)
            elif place in self._held:
                place.since = time.monotonic()
                self._waiting[place] = context

    def give_back(self, place: Place) -> None:
        with self._lock:
            if place in self._held:
                self._waiting.pop(place, None)
                self._remove(place)
                self._hand_on()

    def _caller_fits(self, caller: str | None) -> bool:
        cap = self.per_caller
        return caller is None or cap is None or self._by_caller[caller] < cap

    def _fits(self, caller: str | None) -> bool:
        return len(self._held) < self.limit and self._caller_fits(caller)

    def _add(self, caller: str | None) -> Place:
        place = Place(self, caller)
        self._held.add(place)
        if caller is not None:
            self._by_caller.add(caller)
        return place

    def _remove(self, place: Place) -> None:
        self._held.discard(place)
        if place.caller is not None:
            self._by_caller.remove(place.caller)

    def _hand_on(self) -> None:
        """(holding the lock) Places to the waiting calls they fit, oldest first."""
        for turn in list(self._turns):
            if len(self._held) >= self.limit:
                break
            if self._caller_fits(turn.caller):
                self._turns.remove(turn)
                turn.place = self._add(turn.caller)
                turn.ready.notify()


def take_each(wanted: list[tuple[Pool, str | None]]) -> list[Place] | None:
    """A place of each pool for its caller, or none at all."""
    taken: list[Place] = []
    for pool, caller in wanted:
        place = pool.take(caller)
        if place is None:
            for held in taken:
                held.give_back()
            return None
        taken.append(place)
    return taken
