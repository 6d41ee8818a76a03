"""How much of a resource each caller holds: the one per-caller counter of the pools and
the byte budget."""

from __future__ import annotations


class Held:
    """Each caller's amount held; a caller holding none is dropped, so that callers come
    and go without the table growing. Not locked: its owner's lock guards it."""

    def __init__(self) -> None:
        self._by_caller: dict[str, int] = {}

    def __getitem__(self, caller: str) -> int:
        return self._by_caller.get(caller, 0)

    def add(self, caller: str, amount: int = 1) -> None:
        self._by_caller[caller] = self[caller] + amount

    def remove(self, caller: str, amount: int = 1) -> None:
        left = self[caller] - amount
        if left > 0:
            self._by_caller[caller] = left
        else:
            self._by_caller.pop(caller, None)
