"""Work split over cores: parts cover the range once, in order, aligned; numpy's BLAS on one
thread unless the operator chose."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from pergrad.server.engine.cores import BLAS_THREAD_VARIABLES, on_cores, one_blas_thread, parts


@pytest.mark.parametrize(
    ("count", "pieces", "align"), [(10, 2, 1), (11, 2, 2), (7, 4, 2), (1, 4, 1)]
)
def test_parts_cover_the_range_once_in_order_at_aligned_starts(count, pieces, align) -> None:
    got = parts(count, pieces, align)
    assert [i for part in got for i in range(count)[part]] == list(range(count))
    assert len(got) <= pieces and all(part.start % align == 0 for part in got)


@pytest.mark.parametrize("serial", [True, False])
def test_every_part_is_filled_whether_serial_or_not(serial: bool) -> None:
    out = np.zeros(1001)

    def fill(part: slice) -> None:
        out[part] = np.arange(part.start, part.stop)

    on_cores(len(out), fill, serial=serial)
    np.testing.assert_array_equal(out, np.arange(1001))


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_one_blas_thread_leaves_numpy_blas_on_one_thread(monkeypatch) -> None:
    for name in BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with threadpool_limits(2, user_api="blas"):  # and as it was, after
        one_blas_thread()
        assert _blas_threads() == {1}


def test_an_operators_choice_of_blas_threads_stands(monkeypatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    with threadpool_limits(2, user_api="blas"):
        one_blas_thread()
        assert _blas_threads() == {2}


def test_work_split_from_a_cores_thread_runs_there_and_ends() -> None:
    """A part that splits work of its own (a projection's rows, made by a Gaussian stream)
    runs it on its own thread: parts handed to the pool from every pool thread would wait
    for one another forever."""
    out = np.zeros(4000)

    def outer(part: slice) -> None:
        def inner(sub: slice) -> None:
            out[part.start + sub.start : part.start + sub.stop] += 1

        on_cores(part.stop - part.start, inner, serial=False)

    done = threading.Event()
    threading.Thread(
        target=lambda: (on_cores(len(out), outer, serial=False), done.set()), daemon=True
    ).start()
    assert done.wait(30), "the split work never ended"
    assert (out == 1).all()
