"""Shared passes: requests packed whole, each result its own, cancelled ones skipped."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from pergrad.server.engine import Engine
from pergrad.server.engine.group import (
    FINE_SIZES,
    Job,
    candidate_sizes,
    packs,
    pass_size,
    same_bits_sizes,
)
from pergrad.server.errors import Cancelled
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from tests import oracle
from tests.helpers import assert_close, batch_for, computed_together

GRANULE = 32


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS["mnist_cnn"](), loss=LOSS, jit_compile=False)


@pytest.mark.parametrize("sizes", [[5, 7, 20, 1], [32, 1, 31, 2], [16, 16, 16], [1] * 40])
def test_packs_keep_requests_whole_in_order_within_the_granule(sizes: list[int]) -> None:
    groups = packs(sizes, GRANULE)
    assert [i for group in groups for i in group] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in group) <= GRANULE for group in groups)
    for earlier, later in pairwise(groups):  # a pass closes when full
        assert sum(sizes[i] for i in earlier) + sizes[later[0]] > GRANULE


def _job(engine: Engine, size: int, seed: int, cancelled=None, **request) -> Job:
    x, y = batch_for((28, 28, 1), 10, size, seed=seed)
    return Job(engine.batch(x, y), engine.passes.sink(size, **request), cancelled)


def test_each_job_gets_what_the_engine_computes_for_it_alone(engine: Engine) -> None:
    requests = [(5, {"reduction": "norms"}), (9, {}), (3, {"reduction": "moments"})]
    jobs = [_job(engine, size, seed, **request) for seed, (size, request) in enumerate(requests)]
    results = computed_together(engine, jobs, granule=GRANULE)
    for job, result in zip(jobs, results, strict=True):
        alone = engine.compute(job.batch, **dict(requests)[job.batch.size])
        assert_close({"losses": result.losses}, {"losses": alone.losses})
        for field, value in alone.outputs.items():
            want = value if isinstance(value, dict) else {field: value}
            got = (
                result.outputs[field] if isinstance(value, dict) else {field: result.outputs[field]}
            )
            assert_close(got, want)


def test_a_cancelled_job_is_skipped_and_its_neighbours_are_not(engine: Engine) -> None:
    kept = _job(engine, 4, 1, reduction="norms")
    dropped = _job(engine, 4, 2, lambda: True, reduction="norms")
    result, error = computed_together(engine, [kept, dropped], granule=GRANULE)
    assert isinstance(error, Cancelled)
    alone = computed_together(engine, [_job(engine, 4, 1, reduction="norms")], granule=GRANULE)[0]
    np.testing.assert_array_equal(result.norms, alone.norms)


def test_shared_clipped_sums_straddling_the_bound_match_the_oracle(engine: Engine) -> None:
    x, y = batch_for((28, 28, 1), 10, 8, seed=3)
    _, grads = oracle.per_example(engine.model, LOSS, x.astype(np.float32), y)
    norms = oracle.per_example_norms(grads)
    max_norm = float(np.median(norms)) * (1 + 5e-4)  # some clipped, one just under
    job = Job(
        engine.batch(x, y), engine.passes.sink(8, reduction="clipped_sum", max_norm=max_norm), None
    )
    (result,) = computed_together(engine, [job], granule=GRANULE)
    assert result.num_clipped == int((norms > max_norm).sum()) > 0
    want = oracle.clipped_sum(grads, max_norm)
    for name, value in want.items():
        np.testing.assert_allclose(result.clipped_sum[name], value, rtol=2e-5, atol=1e-6)


def test_a_pass_takes_the_smallest_allowed_size_that_holds_its_rows() -> None:
    sizes = (4, 8, 32)
    assert [pass_size(rows, sizes) for rows in (1, 4, 5, 9, 32)] == [4, 4, 8, 32, 32]


def test_where_a_pass_takes_any_size_every_small_size_is_probed() -> None:
    """With XLA (a function compiled per size) only the powers of two are."""
    assert candidate_sizes(128, every_size=False) == [1, 2, 4, 8, 16, 32, 64]
    fine = candidate_sizes(128, every_size=True)
    assert fine == sorted({*range(1, FINE_SIZES + 1), 64})
    assert candidate_sizes(16, every_size=True) == list(range(1, 16))


def test_a_lone_job_in_a_small_pass_equals_itself_in_a_full_one_to_the_bit(engine) -> None:
    sizes = same_bits_sizes(engine, GRANULE)
    assert sizes[-1] == GRANULE and list(sizes) == sorted(set(sizes))
    lone = computed_together(
        engine, [_job(engine, 3, 1, reduction="norms")], granule=GRANULE, sizes=sizes
    )
    neighbours = [_job(engine, 20, 2), _job(engine, 3, 1, reduction="norms"), _job(engine, 9, 3)]
    shared = computed_together(engine, neighbours, granule=GRANULE, sizes=sizes)[1]
    np.testing.assert_array_equal(shared.losses, lone[0].losses)
    np.testing.assert_array_equal(shared.norms, lone[0].norms)
