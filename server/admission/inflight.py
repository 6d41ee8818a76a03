"""Admission control: the bounds on the examples and bytes calls hold at once, one
`Budget` each (when each is held, and a caller's share, are their rows in `limits`). A
call over a bound is refused at once with RESOURCE_EXHAUSTED instead of queueing without
limit or running the process out of memory; its client can retry later or elsewhere. A
call that alone exceeds a bound could never run, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pergrad.server.admission.budgets import Budget, Unit
from pergrad.server.admission.limits import share


class Admission:
    def __init__(self, *, max_examples: int, max_bytes: int) -> None:
        self.examples = Budget(max_examples, Unit("examples", "--max-inflight-examples"))
        self.bytes = Budget(
            max_bytes, Unit("bytes", "--max-inflight-bytes"), per_caller=share(max_bytes)
        )

    @contextmanager
    def admit(
        self, examples: int, nbytes: int, caller: str = "", request_bytes: int = 0
    ) -> Iterator[None]:
        """Hold `examples` and `nbytes` of result for the block, or refuse at once (the
        call's own `request_bytes`, held already, are not another call's): a call too
        large for either bound is told so before a busy one is."""
        self.examples.check_alone(examples)
        self.bytes.check_alone(nbytes, own=request_bytes)
        give_bytes = self.bytes.take(nbytes, caller, own=request_bytes)
        try:
            give_examples = self.examples.take(examples)
        except BaseException:
            give_bytes()
            raise
        try:
            yield
        finally:
            give_examples()
            give_bytes()

    def hold(self, nbytes: int, caller: str = "") -> Callable[[], None]:
        """Hold a request's `nbytes` until the returned function is called, or refuse."""
        return self.bytes.take(nbytes, caller)
