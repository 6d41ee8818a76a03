"""Batches larger than one request may hold (the server's `max_request_bytes` and
`max_batch`, from `ModelInfo.limits`) are sent in chunks and merged, for every call
that sends a batch: the result is the whole batch's, as the batch-size-1 loop gives it.

The servers here run with limits small enough that the built-in models' batches of a
few hundred examples need several requests; each test checks that its batch does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.client._call import REQUEST_OVERHEAD
from pergrad.server.main import RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.wire.chunked_requests import MESSAGE_BYTES
from tests import oracle
from tests.helpers import assert_close, batch_for, loopback_config
from tests.prometheus import sample_value, scrape

MODEL = "mnist_mlp"
# mnist_mlp's example: 784 float32 inputs and an int32 label; 60 fit one request.
EXAMPLE_BYTES = 784 * 4 + 4
LIMIT = REQUEST_OVERHEAD + 60 * EXAMPLE_BYTES


@contextlib.contextmanager
def _serving(**settings: object) -> Iterator[RunningServer]:
    running = start(loopback_config(MODEL, **settings))
    try:
        yield running
    finally:
        running.stop(0)


@pytest.fixture(scope="module")
def limited() -> Iterator[RunningServer]:
    with _serving(max_request_bytes=LIMIT) as running:
        yield running


@pytest.fixture(scope="module")
def unlimited() -> Iterator[RunningServer]:
    with _serving() as running:
        yield running


def _client(server: RunningServer) -> GradientClient:
    return GradientClient(f"127.0.0.1:{server.port}", timeout=60)


def _over_the_limit(client: GradientClient, size: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's default dtypes (float64 inputs, int64 labels) of `size` examples, whose
    request in the model's dtypes the server would refuse."""
    x, y = batch_for((784,), 10, size, seed=size)
    assert size * EXAMPLE_BYTES > client.model_info(MODEL).limits.max_request_bytes
    return x.astype(np.float64), y.astype(np.int64)


def test_a_batch_over_the_message_limit_matches_the_batch_size_1_loop(limited) -> None:
    with _client(limited) as client:
        x, y = _over_the_limit(client, 150)
        result = client.per_example_gradients(MODEL, x, y)
    losses, grads = oracle.per_example(BUILTIN_MODELS[MODEL](), LOSS, x.astype(np.float32), y)
    assert result.batch_size == 150
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


def test_a_batch_over_max_batch_is_sent_in_chunks() -> None:
    x, y = batch_for((784,), 10, 30, seed=1)
    with _serving(max_batch=12) as running, _client(running) as client:
        result = client.per_example_gradients(MODEL, x, y, reduction="norms")
    _, grads = oracle.per_example(BUILTIN_MODELS[MODEL](), LOSS, x, y)
    assert_close({"norms": result.norms}, {"norms": oracle.per_example_norms(grads)})


def test_a_split_clipped_sum_adds_its_noise_once(limited, unlimited) -> None:
    """Seeded noise of std 1 on every element: added once per part, it would be off by
    about its own size."""
    options = {"reduction": "clipped_sum", "max_norm": 0.5, "noise_multiplier": 2.0, "seed": 7}
    with _client(limited) as split, _client(unlimited) as whole:
        x, y = _over_the_limit(split, 150)
        parts = split.per_example_gradients(MODEL, x, y, **options)
        one = whole.per_example_gradients(MODEL, x, y, **options)
    assert parts.num_clipped == one.num_clipped
    assert_close(parts.clipped_sum, one.clipped_sum)
    assert_close({"norms": parts.norms}, {"norms": one.norms})


def test_a_split_batch_refills_out(limited) -> None:
    with _client(limited) as client:
        x, y = _over_the_limit(client, 150)
        out = client.per_example_gradients(MODEL, x, y, reduction="norms")
        norms = out.norms
        again = client.per_example_gradients(
            MODEL, x[::-1].copy(), y[::-1].copy(), reduction="norms", out=out
        )
        expected = client.per_example_gradients(MODEL, x, y, reduction="norms").norms[::-1]
    assert again is out and out.norms is norms
    assert_close({"norms": norms}, {"norms": expected})


def test_out_of_another_shape_is_refused_before_anything_is_copied(limited) -> None:
    with _client(limited) as client:
        x, y = _over_the_limit(client, 150)
        out = client.per_example_gradients(MODEL, x[:149], y[:149], reduction="norms")
        before = out.losses.copy()
        with pytest.raises(ValueError, match="out= holds float32 \\[149\\] for losses"):
            client.per_example_gradients(MODEL, x, y, reduction="norms", out=out)
    assert np.array_equal(out.losses, before)


def test_inputs_and_labels_of_different_lengths_are_refused_before_splitting(limited) -> None:
    with _client(limited) as client:
        x, y = _over_the_limit(client, 150)
        with pytest.raises(PergradError) as err:
            client.per_example_gradients(MODEL, x, y[:-1], reduction="norms")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "one row per label" in err.value.message


def test_a_stream_sends_a_batch_over_the_limit_in_chunks_and_keeps_the_order(limited) -> None:
    with _client(limited) as client:
        big = _over_the_limit(client, 150)
        small = batch_for((784,), 10, 5, seed=5)
        results = list(client.stream(MODEL, [big, small, big], reduction="norms"))
        alone = [client.per_example_gradients(MODEL, *b, reduction="norms") for b in (big, small)]
    assert [r.batch_size for r in results] == [150, 5, 150]
    for result, expected in zip(results, [alone[0], alone[1], alone[0]], strict=True):
        assert_close({"norms": result.norms}, {"norms": expected.norms})


def test_a_step_on_a_batch_over_the_limit_applies_the_whole_batch() -> None:
    """The same step on a server that takes the batch in one request and on one that
    cannot (its limit fits the model's gradient sum, not the batch): the same weights."""
    model_bytes = sum(
        4 * int(np.prod(v.shape)) for v in BUILTIN_MODELS[MODEL]().trainable_variables
    )
    steps = {"learning_rate": 0.5, "reduction": "clipped_sum", "max_norm": 1.0}
    x, y = batch_for((784,), 10, 200, seed=3)
    assert len(y) * EXAMPLE_BYTES > REQUEST_OVERHEAD + model_bytes
    weights = []
    for limit in (REQUEST_OVERHEAD + model_bytes, None):
        with _serving(max_request_bytes=limit) as running, _client(running) as client:
            done = client.step(MODEL, x, y, **steps)
            assert done.model_version == 2 and done.losses.shape == (200,)
            weights.append(client.get_weights(MODEL)[1])
    assert_close(weights[0], weights[1])


def test_a_dot_reference_that_leaves_no_room_for_an_example_is_refused_unsent(limited) -> None:
    with _client(limited) as client:
        _, current = client.get_weights(MODEL)
        reference = {name: value[None] for name, value in current.items()}  # 407 KB
        x, y = batch_for((784,), 10, 4)
        with pytest.raises(PergradError) as err:
            client.per_example_gradients(MODEL, x, y, reduction="dot", reference=reference)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_request_bytes ({LIMIT}" in err.value.message


def _references_over_the_limit(client: GradientClient) -> dict[str, np.ndarray]:
    """12 reference rows of the whole model (4.9 MB), more than the default limit takes."""
    info = client.model_info(MODEL)
    rng = np.random.default_rng(4)
    reference = {
        v.name: rng.standard_normal((12, *v.shape)).astype(np.float32) for v in info.variables
    }
    assert sum(r.nbytes for r in reference.values()) > info.limits.max_request_bytes
    return reference


def test_a_dot_whose_references_fill_a_request_sends_them_in_chunks(unlimited) -> None:
    """On the default limit: the rows sent a few at a time, the dots side by side as the
    batch-size-1 loop gives them."""
    x, y = batch_for((784,), 10, 50, seed=4)
    with _client(unlimited) as client:
        reference = _references_over_the_limit(client)
        result = client.per_example_gradients(MODEL, x, y, reduction="dot", reference=reference)
    losses, grads = oracle.per_example(BUILTIN_MODELS[MODEL](), LOSS, x, y)
    expected = sum(
        np.einsum(
            "bp,kp->bk",
            g.reshape(len(x), -1).astype(np.float64),
            reference[name].reshape(12, -1).astype(np.float64),
        )
        for name, g in grads.items()
    )
    assert_close(
        {"losses": result.losses, "dots": result.dots}, {"losses": losses, "dots": expected}
    )


def test_a_stream_of_a_dot_whose_references_fill_a_request_keeps_the_order(unlimited) -> None:
    batches = [batch_for((784,), 10, size, seed=size) for size in (7, 3)]
    with _client(unlimited) as client:
        reference = _references_over_the_limit(client)
        options = {"reduction": "dot", "reference": reference}
        results = list(client.stream(MODEL, batches, **options))
        alone = [client.per_example_gradients(MODEL, *b, **options) for b in batches]
    assert [r.dots.shape for r in results] == [(7, 12), (3, 12)]
    for result, expected in zip(results, alone, strict=True):
        assert_close({"dots": result.dots}, {"dots": expected.dots})


def test_a_batch_past_one_message_goes_as_one_request_in_chunks() -> None:
    """Within --max-request-bytes but past the 4 MiB a message may hold: one call, its
    inputs in chunks; the sampled examples' norms are the batch-size-1 loop's."""
    size = MESSAGE_BYTES // EXAMPLE_BYTES + 64
    x, y = batch_for((784,), 10, size, seed=3)
    with _serving(max_request_bytes=4 * MESSAGE_BYTES) as running, _client(running) as client:
        result = client.per_example_gradients(MODEL, x, y, reduction="norms")
        exposition = scrape(running.metrics_port)
    method = {
        "grpc_service": "pergrad.v1.GradientService",
        "grpc_method": "ComputePerExampleGradients",
    }
    assert sample_value(exposition, "grpc_server_handled_total", **method, grpc_code="OK") == 1
    assert sample_value(exposition, "grpc_server_msg_received_total", **method) > 1
    sampled = [0, size // 2, size - 1]
    _, grads = oracle.per_example(BUILTIN_MODELS[MODEL](), LOSS, x[sampled], y[sampled])
    np.testing.assert_allclose(result.norms[sampled], oracle.per_example_norms(grads), rtol=1e-5)
