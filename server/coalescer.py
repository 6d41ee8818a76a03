"""Coalescing: small requests for one model that arrive close together share passes.

Most of a shared server's requests are small (a DP trainer's batch of 64, an influence
job's few hundred), and each engine pass has a fixed cost. Like an inference server's
dynamic batcher, each model's `Coalescer` has one thread that takes the first request
waiting, gathers those arriving within `window_s` (0 by default: those already waiting,
so a lone request waits for nothing and those arriving during a pass share the next),
and runs them together with `pergrad.server.engine.group.shared_rows`, one group per
weights snapshot, in passes sized to what they hold (`group.same_bits_sizes`). Every
request of fewer than `granule` examples takes this path, alone or not, so its result is
the same to the bit whatever shares its pass.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pergrad.server.engine import Engine
from pergrad.server.engine.group import Job, Rows, packs, same_bits_sizes, shared_rows
from pergrad.server.weights import Snapshot
from pergrad.wire.results import GradientResult

_LOGGER = logging.getLogger(__name__)


def granule_for(engine: Engine, max_coalesced_batch: int) -> int:
    """Examples per shared pass: the largest power of two within both --max-coalesced-batch
    and the engine's slice (its memory bound), so no padding beyond the compiled bucket."""
    bound = min(max_coalesced_batch, engine.slice_size)
    return 1 << (bound.bit_length() - 1)


@dataclass
class _Pending:
    job: Job
    snapshot: Snapshot
    done: Future = field(default_factory=Future)


class Coalescer:
    """One model's batcher thread; `compute` blocks its caller until the result is ready."""

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
        self.sizes = same_bits_sizes(engine, granule)
        _LOGGER.info(
            "model %s: shared passes of %s examples (those whose rows match a pass of %d "
            "to the bit)",
            name,
            ", ".join(map(str, self.sizes)),
            granule,
        )
        self._engine = engine
        self._window_s = window_s
        self._on_pass = on_pass
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"coalescer-{name}", daemon=True)
        self._thread.start()

    def takes(self, size: int) -> bool:
        """Whether a request of `size` examples goes through shared passes: one that
        fills a pass could share it with no one, and runs alone (its reduction in the pass)."""
        return size < self.granule

    def compute(self, job: Job, snapshot: Snapshot) -> GradientResult:
        """The job's result (its sink's), its rows computed in a shared pass, then reduced
        here, on the caller's thread, beside the other callers (a reduction's numpy work
        and noise would queue everyone on the batcher thread); its errors raised here."""
        pending = _Pending(job, snapshot)
        self._queue.put(pending)
        rows: Rows = pending.done.result()
        return rows.into(job.sink)

    def close(self) -> None:
        """Finish the requests already queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            gathered, closing = self._gather(first)
            for group in _by_snapshot(gathered):
                self._compute(group)
            if closing:
                return

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        """`first` and the requests arriving within the window, until a pass is full."""
        gathered, size = [first], first.job.batch.size
        deadline = time.monotonic() + self._window_s
        while size < self.granule:
            remaining = deadline - time.monotonic()
            try:  # past the window, only what is already waiting
                pending = self._queue.get(block=remaining > 0, timeout=max(remaining, 0))
            except queue.Empty:
                break
            if pending is None:
                return gathered, True
            gathered.append(pending)
            size += pending.job.batch.size
        return gathered, False

    def _compute(self, group: list[_Pending]) -> None:
        jobs = [p.job for p in group]
        try:
            outcomes = shared_rows(
                self._engine,
                jobs,
                granule=self.granule,
                sizes=self.sizes,
                trainable=group[0].snapshot.trainable,
            )
        except Exception as err:  # never lose the thread: every caller gets the error
            _LOGGER.exception("coalesced pass failed")
            outcomes = [err] * len(group)
        if self._on_pass is not None:
            for pack in packs([job.batch.size for job in jobs], self.granule):
                self._on_pass(len(pack))
        for pending, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, Exception):
                pending.done.set_exception(outcome)
            else:
                pending.done.set_result(outcome)


def _by_snapshot(gathered: list[_Pending]) -> list[list[_Pending]]:
    """The gathered requests grouped by the weights they asked for, in arrival order."""
    groups: dict[tuple[int, str], list[_Pending]] = {}
    for pending in gathered:
        key = (pending.snapshot.version, pending.snapshot.weights_id)
        groups.setdefault(key, []).append(pending)
    return list(groups.values())


class Coalescers:
    """The coalescers of a server's models, each started when its model is first asked."""

    def __init__(
        self,
        *,
        window_ms: float,
        max_coalesced_batch: int,
        on_pass: Callable[[str, int], None] | None = None,
    ) -> None:
        self._window_s = window_ms / 1000
        self._max = max_coalesced_batch
        self._on_pass = on_pass
        self._started: dict[str, Coalescer] = {}
        self._lock = threading.Lock()

    def get(self, name: str, engine: Engine) -> Coalescer | None:
        """Model `name`'s coalescer; None when coalescing is off (--max-coalesced-batch 0)."""
        if self._max == 0:
            return None
        with self._lock:
            if name not in self._started:
                report = self._on_pass
                self._started[name] = Coalescer(
                    engine,
                    window_s=self._window_s,
                    granule=granule_for(engine, self._max),
                    on_pass=None if report is None else lambda requests: report(name, requests),
                    name=name,
                )
            return self._started[name]

    def close(self) -> None:
        with self._lock:
            started, self._started = list(self._started.values()), {}
        for coalescer in started:
            coalescer.close()
