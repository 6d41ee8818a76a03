"""Whether and how a server's small requests share passes: the examples a shared pass
holds (`granule_for`), each model's coalescer, started when the model is first asked
(`Coalescers`), and what a replica reports of it, which decides a result's bits too
(`served_plan`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pergrad.server.coalescer import Coalescer
from pergrad.server.engine import Engine
from pergrad.server.engine.engine import fingerprint

UNRESOLVED_COALESCING = (
    "--max-coalesced-batch auto must be made a number first (devices.with_coalescing_resolved)"
)


def granule_for(engine: Engine, max_coalesced_batch: int) -> int:
    """Examples per shared pass: the largest power of two within both --max-coalesced-batch
    and the engine's slice (its memory bound), so no padding beyond the compiled bucket."""
    bound = min(max_coalesced_batch, engine.slice_size)
    return 1 << (bound.bit_length() - 1)


def served_plan(engine: Engine, max_coalesced_batch: int) -> tuple[str, str]:
    """What a replica reports of how it computes a model, and its fingerprint: the
    engine's plan and whether small requests share passes, which decides their bits too
    (a shared pass's rows are reduced outside it, a request alone inside its own)."""
    if max_coalesced_batch:
        granule = granule_for(engine, max_coalesced_batch)
        sharing = f"requests of fewer than {granule} examples share passes"
    else:
        sharing = "no shared passes"
    text = f"{engine.plan_text}; {sharing}"
    return text, fingerprint(text)


class Coalescers:
    """The coalescers of a server's models, each started when its model is first asked."""

    def __init__(
        self,
        *,
        window_ms: float,
        max_coalesced_batch: int | None,  # None: unresolved (`Config.coalescing_bound`)
        on_pass: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_coalesced_batch is None:
            raise ValueError(UNRESOLVED_COALESCING)
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
