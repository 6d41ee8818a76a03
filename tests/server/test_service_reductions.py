"""Reductions over the wire: the client gets what the in-process engine computes, and what
the Keras-only oracle (tests/oracle.py) says they are."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.engine import Engine
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from tests import oracle
from tests.helpers import assert_close, batch_for


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS["mnist_cnn"](), loss=LOSS, jit_compile=False)


def _batch(size: int = 9):
    return batch_for((28, 28, 1), 10, size, seed=7)


@pytest.mark.parametrize(
    ("reduction", "options", "fields"),
    [
        ("norms", {}, ["norms", "variable_norms"]),
        (
            "clipped_sum",
            {"max_norm": 1.0, "noise_multiplier": 0.5, "seed": 3},
            ["clipped_sum", "norms", "num_clipped"],
        ),
        ("moments", {}, ["sum", "sum_squares"]),
        ("project", {"dim": 64, "seed": 2, "projection": "gaussian"}, ["projections"]),
    ],
)
def test_remote_reduction_equals_in_process_engine(
    client: GradientClient, engine: Engine, reduction: str, options: dict, fields: list[str]
) -> None:
    x, y = _batch()
    remote = client.per_example_gradients("mnist_cnn", x, y, reduction=reduction, **options)
    local = engine.per_example_gradients(x, y, reduction=reduction, **options)
    assert remote.gradients == {} and remote.model_version == 1
    assert_close({"losses": remote.losses}, {"losses": local.losses})
    for name in fields:
        got, want = getattr(remote, name), getattr(local, name)
        if isinstance(want, dict):
            assert_close(got, want)
        elif isinstance(want, int):
            assert got == want
        else:
            assert_close({name: got}, {name: want})


def test_remote_norms_and_clipped_sum_match_keras_oracle(client: GradientClient) -> None:
    """The bound lies between the median oracle norm and the next: the larger half clipped."""
    x, y = _batch()
    _, grads = oracle.per_example(BUILTIN_MODELS["mnist_cnn"](), LOSS, x, y)
    norms = oracle.per_example_norms(grads)
    middle = len(norms) // 2
    max_norm = float(np.mean(np.sort(norms)[middle : middle + 2]))
    remote = client.per_example_gradients(
        "mnist_cnn", x, y, reduction="clipped_sum", max_norm=max_norm
    )
    assert remote.num_clipped == int(np.sum(norms > max_norm)) == len(x) // 2
    assert_close({"norms": remote.norms}, {"norms": norms})
    assert_close(remote.clipped_sum, oracle.clipped_sum(grads, max_norm))


def test_remote_dot_with_reference_gradients(client: GradientClient, engine: Engine) -> None:
    x, y = _batch()
    rng = np.random.default_rng(0)
    reference = {
        v.path: rng.standard_normal((4, *v.shape)) for v in engine.model.trainable_variables
    }
    remote = client.per_example_gradients("mnist_cnn", x, y, reduction="dot", reference=reference)
    local = engine.per_example_gradients(x, y, reduction="dot", reference=reference)
    assert remote.dots.shape == (9, 4)
    assert_close({"dots": remote.dots}, {"dots": local.dots})


def test_remote_noise_is_the_same_bytes_for_the_same_seed(client: GradientClient) -> None:
    x, y = _batch()
    options = {"reduction": "clipped_sum", "max_norm": 0.1, "noise_multiplier": 1.0, "seed": 11}
    first = client.per_example_gradients("mnist_cnn", x, y, **options)
    second = client.per_example_gradients("mnist_cnn", x, y, **options)
    for name, value in first.clipped_sum.items():
        assert value.tobytes() == second.clipped_sum[name].tobytes()


def test_variables_filter_returns_only_those_gradients(client: GradientClient) -> None:
    x, y = _batch(3)
    result = client.per_example_gradients("mnist_cnn", x, y, variables=["logits/kernel"])
    assert list(result.gradients) == ["logits/kernel"]
    assert result.gradients["logits/kernel"].shape == (3, 32, 10)


def test_stream_carries_the_reduction(client: GradientClient) -> None:
    batches = [_batch(size) for size in (2, 5)]
    results = list(client.stream("mnist_cnn", batches, reduction="norms"))
    assert [r.norms.shape for r in results] == [(2,), (5,)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduction": "clipped_sum"}, "max_norm: clipped_sum needs a finite positive bound"),
        ({"reduction": "norms", "dim": 3}, "['dim']: not options of reduction 'norms'"),
        ({"variables": ["conv9/kernel"]}, "variables: unknown ['conv9/kernel']"),
        ({"reduction": "dot", "reference": {"logits/bias": np.zeros((2, 10))}}, "missing"),
    ],
)
def test_bad_reduction_requests_are_invalid_arguments(
    client: GradientClient, kwargs: dict, message: str
) -> None:
    x, y = _batch(2)
    with pytest.raises(PergradError) as err:
        client.per_example_gradients("mnist_cnn", x, y, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message


def test_unknown_reduction_is_refused_by_the_client(client: GradientClient) -> None:
    x, y = _batch(2)
    with pytest.raises(PergradError, match="reduction: unknown 'median'"):
        client.per_example_gradients("mnist_cnn", x, y, reduction="median")
