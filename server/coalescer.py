"""Coalescing: small requests for one model that arrive close together share passes.

Most of a shared server's requests are small (a DP trainer's batch of 64, an influence
job's few hundred), and each engine pass has a fixed cost. Like an inference server's
dynamic batcher, each model's `Coalescer` gathers the requests waiting (and, with
`window_s`, those arriving within it; 0 by default, so a lone request waits for nothing
and those arriving during a pass share a later one) and runs them together with
`pergrad.server.engine.group.shared_rows`, one group per weights snapshot, in a pass
sized to what it holds (`group.same_bits_sizes`). Every request of fewer than `granule`
examples takes this path, alone or not, so its result is the same to the bit whatever
shares its pass.

A pass runs on the thread of one of its requests (its leader), which holds a worker's place
like any call that computes, and passes are shared fairly between callers (a
token, or a connection on a server without tokens): a caller has at most one shared pass
running at a time, and its other requests wait for it to end; a model runs at most
`LANES` shared passes at once; a pass takes the waiting requests of callers with none
running, the least recently served caller first, one request per caller in turn. So
a caller sending expensive small requests holds one lane, and another caller's request
starts in the other at once instead of queueing behind it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pergrad.server.engine import Engine
from pergrad.server.engine.group import Job, Rows, same_bits_sizes, shared_rows
from pergrad.server.errors import Cancelled
from pergrad.server.weights import Snapshot
from pergrad.wire.results import GradientResult

_LOGGER = logging.getLogger(__name__)
# Shared passes of one model running at once: one caller's, and another's beside it.
LANES = 2
# How often a request waiting for a pass looks whether its call has ended.
POLL_S = 0.5


@dataclass(eq=False)
class _Pending:
    job: Job
    snapshot: Snapshot
    caller: str
    wake: threading.Condition  # on the coalescer's lock: this request's turn, or answer
    rows: Rows | None = None
    error: Exception | None = None
    taken: bool = False
    done: bool = False
    order: int = 0  # arrival order, to keep each caller's requests in the order they came

    def key(self) -> tuple:
        """What requests sharing a pass have in common: the weights, and each input's
        and the labels' example shape and dtype (a model may take any sequence length,
        and a pass stacks its requests' examples)."""
        batch = self.job.batch
        shapes = tuple((a.shape[1:], a.dtype.str) for a in (*batch.xs, batch.y))
        return self.snapshot.version, self.snapshot.weights_id, shapes


class Coalescer:
    """One model's shared passes; `compute` blocks its caller until its result is ready."""

    def __init__(
        self,
        engine: Engine,
        *,
        window_s: float,
        granule: int,
        on_pass: Callable[[int], None] | None = None,
        name: str = "",
    ) -> None:
        self.granule = granule
        self._name = name
        self._sizes: tuple[int, ...] | None = None
        self._probing = threading.Lock()
        self._engine = engine
        self._window_s = window_s
        self._on_pass = on_pass
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # nothing waiting or running: close()
        self._waiting: list[_Pending] = []  # arrival order
        self._lanes = 0  # shared passes running
        self._running: set[str] = set()  # callers with a request in one of them
        self._served: dict[str, int] = {}  # caller -> the pass that last served it
        self._passes = itertools.count(1)
        self._arrivals = itertools.count()
        self._gatherer: _Pending | None = None  # the leader gathering its pass

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes a shared pass may have, found by probe passes before the first one
        (not as the coalescer is made: a request that runs alone never waits for them, nor
        does a call to another model)."""
        with self._probing:
            if self._sizes is None:
                self._sizes = same_bits_sizes(self._engine, self.granule)
                _LOGGER.info(
                    "model %s: shared passes of %s examples (those whose rows match a pass "
                    "of %d to the bit)",
                    self._name,
                    ", ".join(map(str, self._sizes)),
                    self.granule,
                )
            return self._sizes

    def takes(self, size: int) -> bool:
        """Whether a request of `size` examples goes through shared passes: one that
        fills a pass could share it with no one, and runs alone (its reduction in the pass)."""
        return size < self.granule

    def compute(self, job: Job, snapshot: Snapshot, caller: str = "") -> GradientResult:
        """The job's result (its sink's), its rows computed in a shared pass, then reduced
        here, on the caller's thread, beside the other callers; its errors raised here."""
        wake = threading.Condition(self._lock)
        pending = _Pending(job, snapshot, caller, wake, order=next(self._arrivals))
        group = self._wait_or_lead(pending)
        if group:
            self._run(group)
        if pending.error is not None:
            raise pending.error
        assert pending.rows is not None
        return pending.rows.into(job.sink)

    def close(self) -> None:
        """Wait for the requests already waiting or running to be answered."""
        with self._idle:
            self._idle.wait_for(lambda: not self._waiting and not self._lanes)

    def _wait_or_lead(self, pending: _Pending) -> list[_Pending]:
        """[] once another pass has answered `pending`; else the group `pending` leads.
        It sleeps until woken for its turn (`_wake_next`) or its answer (`_answer`), and
        every POLL_S to look whether its call has ended."""
        with self._lock:
            self._waiting.append(pending)
            self._wake_next()
            while not pending.done:
                if not pending.taken and self._next_leader() is pending:
                    return self._gather(pending)
                pending.wake.wait(POLL_S)
                if not pending.taken and not pending.done and self._ended(pending):
                    self._waiting.remove(pending)
                    self._forget_if_idle(pending.caller)
                    self._wake_next()  # another may lead now
                    self._idle.notify_all()
                    raise Cancelled("call cancelled or past its deadline before its pass")
            return []

    def _wake_next(self) -> None:
        """Wake the one request whose turn it may be (called locked): the leader gathering
        its pass (a request that may join it came), else, with a lane free, the next to
        lead. The others sleep on: waking every waiting thread at every change cost
        16 clients' calls 85 context switches each against 53 without coalescing."""
        turn = self._gatherer or self._next_leader()
        if turn is not None:
            turn.wake.notify()

    @staticmethod
    def _ended(pending: _Pending) -> bool:
        cancelled = pending.job.cancelled
        return cancelled is not None and cancelled()

    def _next_leader(self) -> _Pending | None:
        """The request to lead the next pass, if a lane is free and none is gathering: of
        the requests whose callers have no pass running, the least recently served
        caller's first."""
        if self._gatherer is not None or self._lanes >= LANES:
            return None
        ready = [p for p in self._waiting if p.caller not in self._running]
        return min(ready, key=self._turn, default=None)

    def _turn(self, pending: _Pending) -> tuple[int, int]:
        return self._served.get(pending.caller, 0), pending.order

    def _gather(self, leader: _Pending) -> list[_Pending]:
        """The leader's pass: the waiting requests of callers with no pass running, within
        the window, least recently served caller first (called and returning locked)."""
        self._gatherer = leader
        deadline = time.monotonic() + self._window_s
        while (remaining := deadline - time.monotonic()) > 0 and self._room(leader) > 0:
            leader.wake.wait(remaining)
        group = self._fair_pick(leader)
        self._gatherer = None
        number = next(self._passes)
        self._lanes += 1
        for pending in group:
            pending.taken = True
            self._waiting.remove(pending)
            self._running.add(pending.caller)
            self._served[pending.caller] = number
        self._wake_next()  # a lane may be free for another caller's pass
        return group

    def _eligible(self, leader: _Pending) -> list[_Pending]:
        """The waiting requests that may share the leader's pass: of callers with no pass
        running, for the same weights, with examples of the same shapes."""
        key = leader.key()
        return [p for p in self._waiting if p.caller not in self._running and p.key() == key]

    def _room(self, leader: _Pending) -> int:
        return self.granule - sum(p.job.batch.size for p in self._eligible(leader))

    def _fair_pick(self, leader: _Pending) -> list[_Pending]:
        """The leader, then the other eligible requests one per caller in turn (callers
        least recently served first) while they fit in one pass."""
        queues: dict[str, list[_Pending]] = {}
        for pending in self._eligible(leader):
            if pending is not leader:
                queues.setdefault(pending.caller, []).append(pending)
        order = sorted(queues, key=lambda c: self._turn(queues[c][0]))
        group, room = [leader], self.granule - leader.job.batch.size
        for turn in itertools.count():
            offered = [queues[c][turn] for c in order if turn < len(queues[c])]
            if not offered:
                break
            for pending in offered:
                if pending.job.batch.size <= room:
                    group.append(pending)
                    room -= pending.job.batch.size
        return sorted(group, key=lambda p: p.order)

    def _run(self, group: list[_Pending]) -> None:
        """Run the leader's pass (unlocked), then answer every request in it."""
        outcomes: list[Rows | Exception] = []
        try:
            outcomes = shared_rows(
                self._engine,
                [p.job for p in group],
                granule=self.granule,
                sizes=self.sizes,
                trainable=group[0].snapshot.trainable,
            )
        except Exception as err:  # every request of the pass gets the error
            _LOGGER.exception("coalesced pass failed")
            outcomes = [err] * len(group)
        finally:
            self._answer(group, outcomes)
        if self._on_pass is not None:
            self._on_pass(len(group))

    def _answer(self, group: list[_Pending], outcomes: list[Rows | Exception]) -> None:
        """Give each request its outcome (an error where there is none: the pass ended
        abnormally) and the lane back."""
        with self._lock:
            for index, pending in enumerate(group):
                outcome = outcomes[index] if index < len(outcomes) else None
                if isinstance(outcome, Rows):
                    pending.rows = outcome
                else:
                    pending.error = outcome or Cancelled("the shared pass ended abnormally")
                pending.done = True
                pending.wake.notify()
                self._running.discard(pending.caller)
            self._lanes -= 1
            for pending in group:
                self._forget_if_idle(pending.caller)
            self._wake_next()
            self._idle.notify_all()

    def _forget_if_idle(self, caller: str) -> None:
        """Drop what is kept of a caller with nothing waiting or running (callers come
        and go with their connections: what is kept of them stays bounded)."""
        if caller in self._running or any(p.caller == caller for p in self._waiting):
            return
        self._served.pop(caller, None)
