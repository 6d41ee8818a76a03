"""Coalescing: small requests that arrive together share passes, and each result is the
same to the bit as the request's result alone, right by the batch-size-1 loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import keras
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server import coalescer as coalescer_module
from pergrad.server.coalescer import Coalescer
from pergrad.server.engine import Engine
from pergrad.server.engine.group import Job
from pergrad.server.main import RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.weights import WeightsStore
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.results import GradientResult
from tests import oracle
from tests.helpers import batch_for, loopback_config
from tests.prometheus import sample_value, scrape
from tests.release.every_reduction import OPTIONS
from tests.zoo import VOCABULARY

MODEL = "mnist_mlp"
WINDOW_MS = 400.0  # long: requests started together surely share, even on a loaded machine
GRANULE = 64
PASSES = "pergrad_coalesced_pass_requests"


@pytest.fixture(scope="module")
def coalescing() -> Iterator[RunningServer]:
    config = loopback_config(MODEL, batch_window_ms=WINDOW_MS, max_coalesced_batch=GRANULE)
    running = start(config)
    yield running
    running.stop(0)


def _client(running: RunningServer) -> GradientClient:
    return GradientClient(f"127.0.0.1:{running.port}", timeout=60)


def _passes(running: RunningServer) -> tuple[float, float]:
    """(shared passes so far, requests they held)."""
    exposition = scrape(running.metrics_port)
    count = sample_value(exposition, f"{PASSES}_count", model=MODEL) or 0.0
    return count, sample_value(exposition, f"{PASSES}_sum", model=MODEL) or 0.0


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's return value (or exception), the calls started at the same moment."""
    barrier = threading.Barrier(len(calls))
    outcomes: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        barrier.wait()
        try:
            outcomes[index] = calls[index]()
        except Exception as err:
            outcomes[index] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def _assert_identical(got: GradientResult, want: GradientResult) -> None:
    np.testing.assert_array_equal(got.losses, want.losses)
    assert got.outputs.keys() == want.outputs.keys()
    for field, value in want.outputs.items():
        if isinstance(value, dict):
            assert value.keys() == got.outputs[field].keys()
            for name, array in value.items():
                np.testing.assert_array_equal(got.outputs[field][name], array, err_msg=field)
        else:
            np.testing.assert_array_equal(got.outputs[field], value, err_msg=field)


@pytest.mark.parametrize("reduction", CATALOGUE.names)
def test_a_shared_request_equals_itself_alone_to_the_bit(coalescing, reduction: str) -> None:
    with _client(coalescing) as client:
        info = client.model_info(MODEL)
        options = OPTIONS[reduction](info)
        x, y = batch_for((784,), 10, 5, seed=1)
        alone = client.per_example_gradients(MODEL, x, y, reduction=reduction, **options)
        neighbours = [
            (batch_for((784,), 10, 7, seed=2), {"reduction": "norms"}),
            (batch_for((784,), 10, 16, seed=3), {"reduction": "none"}),
            (
                batch_for((784,), 10, 3, seed=4),
                OPTIONS["clipped_sum"](info) | {"seed": 99, "reduction": "clipped_sum"},
            ),
        ]
        before = _passes(coalescing)
        shared, *others = _together(
            [
                lambda: client.per_example_gradients(MODEL, x, y, reduction=reduction, **options),
                *(
                    lambda b=b, o=o: client.per_example_gradients(MODEL, *b, **o)
                    for b, o in neighbours
                ),
            ]
        )
        after = _passes(coalescing)
    assert not [o for o in others if isinstance(o, Exception)], others
    assert after[1] - before[1] == 4  # every request went through shared passes
    assert after[0] - before[0] < 4  # and some of them shared one
    _assert_identical(shared, alone)


def test_shared_results_match_the_batch_size_one_loop(coalescing) -> None:
    model = BUILTIN_MODELS[MODEL]()
    batches = [batch_for((784,), 10, size, seed=size) for size in (4, 9, 2)]
    with _client(coalescing) as client:
        results = _together([lambda b=b: client.per_example_gradients(MODEL, *b) for b in batches])
    for (x, y), result in zip(batches, results, strict=True):
        losses, grads = oracle.per_example(model, LOSS, x.astype(np.float32), y)
        np.testing.assert_allclose(result.losses, losses, rtol=1e-5, atol=1e-6)
        for name, want in grads.items():
            np.testing.assert_allclose(result.gradients[name], want, rtol=1e-5, atol=1e-6)


def test_a_cancelled_request_leaves_its_neighbours_whole(coalescing) -> None:
    x, y = batch_for((784,), 10, 6, seed=5)
    with _client(coalescing) as client:
        alone = client.per_example_gradients(MODEL, x, y, reduction="norms")
        hasty, patient = _together(
            [
                lambda: client.per_example_gradients(MODEL, x, y, timeout=WINDOW_MS / 4000),
                lambda: client.per_example_gradients(MODEL, x, y, reduction="norms"),
            ]
        )
        assert isinstance(hasty, PergradError)
        assert hasty.code == grpc.StatusCode.DEADLINE_EXCEEDED
        _assert_identical(patient, alone)
        assert client.per_example_gradients(MODEL, x, y, reduction="norms").norms.shape == (6,)


@pytest.mark.parametrize("size", [GRANULE, GRANULE + 1])
def test_requests_that_fill_a_pass_run_on_their_own(coalescing, size: int) -> None:
    x, y = batch_for((784,), 10, size)
    before = _passes(coalescing)
    with _client(coalescing) as client:
        result = client.per_example_gradients(MODEL, x, y, reduction="norms")
    assert result.norms.shape == (size,)
    assert _passes(coalescing) == before


def test_requests_that_together_fill_a_pass_share_it() -> None:
    """Two callers' requests of half a pass each: the first leads a pass and waits for
    more within --batch-window-ms (30 s, half the client's timeout: it waits only until
    its room is filled, however late the second comes on a loaded machine); the second
    fills it exactly, and both go in that one pass (before: the request that filled the
    room was left out, and a second pass ran, after its own window: the same results at
    half the throughput)."""
    half = GRANULE // 2
    config = loopback_config(MODEL, batch_window_ms=30_000.0, max_coalesced_batch=GRANULE)
    running = start(config)
    batches = [batch_for((784,), 10, half, seed=seed) for seed in (1, 2)]
    try:
        with _client(running) as first, _client(running) as second:
            results = _together(
                [
                    lambda c=c, b=b: c.per_example_gradients(MODEL, *b, reduction="norms")
                    for c, b in zip((first, second), batches, strict=True)
                ]
            )
        assert [r.norms.shape for r in results] == [(half,), (half,)]
        assert _passes(running) == (1.0, 2.0)  # one shared pass, holding both requests
    finally:
        running.stop(0)


def test_zero_max_coalesced_batch_turns_coalescing_off() -> None:
    running = start(loopback_config(MODEL, max_coalesced_batch=0))
    try:
        with _client(running) as client:
            x, y = batch_for((784,), 10, 3)
            assert client.per_example_gradients(MODEL, x, y, reduction="norms").norms.shape == (3,)
        assert _passes(running) == (0.0, 0.0)
    finally:
        running.stop(0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS[MODEL](), loss=LOSS, jit_compile=False)


def test_requests_for_different_weights_share_no_pass(engine) -> None:
    store = WeightsStore(engine.variables, engine.passes.initial_weights())
    first = store.current
    pairs = zip(engine.variables, first.trainable, strict=True)
    scaled = {v.name: 1.5 * w.numpy() for v, w in pairs}
    second = store.replace(scaled)
    coalescer = Coalescer(engine, window_s=WINDOW_MS / 1000, granule=GRANULE)
    x, y = batch_for((784,), 10, 4)

    def compute(snapshot) -> GradientResult:
        job = Job(engine.batch(x, y), engine.passes.sink(4, reduction="norms"))
        return coalescer.compute(job, snapshot)

    try:
        alone = [compute(first), compute(second)]
        together = _together([lambda: compute(first), lambda: compute(second)])
    finally:
        coalescer.close()
    assert not np.array_equal(alone[0].norms, alone[1].norms)
    for got, want in zip(together, alone, strict=True):
        _assert_identical(got, want)


def test_every_waiting_request_is_woken_for_its_turn(engine, monkeypatch) -> None:
    """3 callers with 4 requests each at once, over the two lanes: each request is woken
    when it may lead or is answered, never left to its poll (made a minute long here)."""
    monkeypatch.setattr(coalescer_module, "POLL_S", 60.0)
    snapshot = WeightsStore(engine.variables, engine.passes.initial_weights()).current
    coalescer = Coalescer(engine, window_s=0.0, granule=GRANULE)
    x, y = batch_for((784,), 10, 4)
    results: list[GradientResult] = []

    def request(caller: str) -> None:
        job = Job(engine.batch(x, y), engine.passes.sink(4, reduction="norms"))
        results.append(coalescer.compute(job, snapshot, caller))

    threads = [
        threading.Thread(target=request, args=(caller,), daemon=True)
        for caller in "abc"
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    try:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert len(results) == len(threads)
    finally:
        coalescer.close()


def test_requests_of_different_sequence_lengths_each_get_their_own_result() -> None:
    """A model over sequences of any length: two callers' requests of lengths 5 and 9 at
    once share no pass, and each gets its result alone (before: stacked into one pass,
    which failed both)."""
    tokens = keras.Input((None,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCABULARY, 4)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(3)(pooled))
    engine = Engine(model, loss=LOSS, jit_compile=False)
    coalescer = Coalescer(engine, window_s=WINDOW_MS / 1000, granule=8)
    snapshot = WeightsStore(engine.variables, engine.passes.initial_weights()).current
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(1, VOCABULARY, (size, length)).astype(np.int32), rng.integers(0, 3, size))
        for size, length in [(2, 5), (3, 9)]
    ]

    def compute(x: np.ndarray, y: np.ndarray, caller: str) -> GradientResult:
        job = Job(engine.batch(x, y), engine.passes.sink(len(y), reduction="norms"))
        return coalescer.compute(job, snapshot, caller)

    try:
        alone = [compute(x, y, "one") for x, y in batches]
        together = _together(
            [lambda b=b, c=c: compute(*b, c) for b, c in zip(batches, "ab", strict=True)]
        )
    finally:
        coalescer.close()
    for got, want in zip(together, alone, strict=True):
        _assert_identical(got, want)
