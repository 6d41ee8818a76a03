"""How much of a resource each caller holds: the one per-caller counter of the pools and
the byte budget."""

from __future__ import annotations

from collections import Counter


class Held(Counter[str]):
    """Each caller's amount held; a caller holding none is dropped, so that callers come
    and go without the table growing. Not locked: its owner's lock guards it."""

    def remove(self, caller: str, amount: int = 1) -> None:
        self[caller] -= amount
        if self[caller] <= 0:
            del self[caller]
