"""The prefetching thread: same items, same order, errors passed on, early stops honoured."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pergrad.server.prefetch import prefetched


def test_items_arrive_in_order() -> None:
    assert list(prefetched(iter(range(50)))) == list(range(50))


def test_producer_error_is_raised_after_earlier_items() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("broken slice")

    got = []
    with pytest.raises(ValueError, match="broken slice"):
        for item in prefetched(failing()):
            got.append(item)
    assert got == [1]


def test_producer_stops_when_the_consumer_does() -> None:
    produced, done = [], threading.Event()

    def endless() -> Iterator[int]:
        try:
            for i in range(10_000):
                produced.append(i)
                yield i
        finally:
            done.set()

    items = prefetched(endless(), depth=1)
    assert next(items) == 0
    items.close()
    assert done.wait(timeout=5)
    assert len(produced) <= 3
