"""Running a producer one step ahead in a thread, so computing overlaps sending."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

_T = TypeVar("_T")
_DONE = object()


def prefetched(
    items: Iterator[_T], *, stop: Callable[[], bool] = lambda: False, depth: int = 1
) -> Iterator[_T]:
    """The items of `items`, produced in a background thread up to `depth` ahead.

    The producer's exception is raised here, in order. When the consumer stops early
    (closes the generator) or `stop()` turns true, the producer stops at its next item.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    finished = threading.Event()

    def put(item: object) -> bool:
        while not finished.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                if stop():
                    finished.set()
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as err:  # handed to the consumer, which raises it
            put(err)

    thread = threading.Thread(target=produce, name="pergrad-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if stop():
                return
    finally:
        finished.set()
