"""Models of several inputs end to end: ModelInfo lists them, the client takes a mapping
or a list, the server checks every input, `pergrad grads` reads them from the .npz by
name, and the served gradients and every reduction's outputs match the Keras-only oracle
(tests/oracle.py), run on the model as it was before saving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pytest

from pergrad.cli import main as cli
from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from pergrad.wire.catalogue import CATALOGUE, Output
from tests import oracle
from tests.helpers import assert_close, loopback_config

L = keras.layers


def _two_inputs() -> keras.Model:
    """Numeric features and token ids, a dict of inputs, an embedding on the ids; layers
    named, so variable names do not depend on the models built before."""
    init = keras.initializers.GlorotUniform
    numeric = keras.Input((5,), name="numeric")
    tokens = keras.Input((4,), dtype="int32", name="tokens")
    embedding = L.Embedding(30, 3, embeddings_initializer=init(1), name="embedding")
    embedded = L.Flatten()(embedding(tokens))
    hidden = L.Dense(6, "relu", kernel_initializer=init(2), name="dense")
    h = hidden(L.Concatenate()([numeric, embedded]))
    output = L.Dense(3, kernel_initializer=init(3), name="logits")
    model = keras.Model({"numeric": numeric, "tokens": tokens}, output(h))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def model() -> keras.Model:
    return _two_inputs()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: keras.Model) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("several")
    model.save(directory / "pair.keras")
    running = start(loopback_config("pair.keras", model_dir=directory))
    yield running
    running.stop(0)


def _batch(size: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {"numeric": rng.standard_normal((size, 5)), "tokens": rng.integers(0, 30, (size, 4))}
    return x, rng.integers(0, 3, size)


def _oracle(model: keras.Model, x: dict[str, np.ndarray], y: np.ndarray):
    """The oracle's (losses, gradients) of the batch as the server casts it."""
    as_sent = {"numeric": x["numeric"].astype(np.float32), "tokens": x["tokens"].astype(np.int32)}
    return oracle.per_example(model, LOSS, as_sent, y.astype(np.int32))


def _client(served: RunningServer) -> GradientClient:
    return GradientClient(f"127.0.0.1:{served.port}", timeout=60)


def test_model_info_lists_every_input_by_name(served) -> None:
    with _client(served) as client:
        info = client.model_info("pair")
    assert [(i.name, i.dtype.name, i.shape) for i in info.inputs] == [
        ("numeric", "float32", (-1, 5)),
        ("tokens", "int32", (-1, 4)),
    ]


def test_a_mapping_and_a_list_in_model_order_give_the_same_gradients(served) -> None:
    x, y = _batch(5)
    with _client(served) as client:
        by_name = client.per_example_gradients("pair", x, y)
        in_order = client.per_example_gradients("pair", [x["numeric"], x["tokens"]], y)
    for name, grad in by_name.gradients.items():
        np.testing.assert_array_equal(in_order.gradients[name], grad)
    assert by_name.losses.shape == (5,)


def test_gradients_and_norms_match_the_keras_oracle(served, model) -> None:
    """Over the wire, by name and in model order: losses, full per-example gradients and
    norms (whole and per variable) within 1e-5 of the oracle's."""
    x, y = _batch(5, seed=2)
    losses, grads = _oracle(model, x, y)
    with _client(served) as client:
        by_name = client.per_example_gradients("pair", x, y)
        in_order = client.per_example_gradients("pair", [x["numeric"], x["tokens"]], y)
        norms = client.per_example_gradients("pair", x, y, reduction="norms")
    for result in (by_name, in_order, norms):
        assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(by_name.gradients, grads)
    assert_close(in_order.gradients, grads)
    assert_close({"norms": norms.norms}, {"norms": oracle.per_example_norms(grads)})
    assert_close(
        norms.variable_norms, {v: oracle.per_example_norms({v: g}) for v, g in grads.items()}
    )


def _expected(reduction: str, grads: dict[str, np.ndarray], options: dict) -> dict:
    """The oracle's value of each output of `reduction` it can compute (all but the
    projections, whose random matrix only the engine draws)."""
    norms = oracle.per_example_norms(grads)
    if reduction == "none":
        return {"gradients": grads}
    if reduction == "norms":
        return {
            "norms": norms,
            "variable_norms": {v: oracle.per_example_norms({v: g}) for v, g in grads.items()},
        }
    if reduction == "clipped_sum":
        return {
            "clipped_sum": oracle.clipped_sum(grads, options["max_norm"]),
            "norms": norms,
            "num_clipped": int(np.sum(norms > options["max_norm"])),
        }
    if reduction == "moments":
        return {
            "sum": {v: g.sum(axis=0, dtype=np.float64) for v, g in grads.items()},
            "sum_squares": {
                v: np.square(g, dtype=np.float64).sum(axis=0) for v, g in grads.items()
            },
        }
    if reduction == "dot":
        ((name, reference),) = options["reference"].items()
        flat = reference.reshape(len(reference), -1).astype(np.float64)
        return {"dots": grads[name].reshape(len(grads[name]), -1) @ flat.T}
    return {}


def _same(output: Output, actual: Any, expected: Any) -> None:
    """One output: a count exactly, arrays (or {variable: array}) within 1e-5."""
    if output.rows == "count":
        assert int(actual) == int(expected), output.field
    elif output.per_variable:
        assert_close(actual, expected)
    else:
        assert_close({output.field: np.asarray(actual)}, {output.field: np.asarray(expected)})


@pytest.mark.parametrize("reduction", CATALOGUE.names)
def test_every_reduction_takes_several_inputs(served, model, reduction: str) -> None:
    """Every output of every reduction, from one request and from micro-batches of 3
    merged by the client, agrees with the other and with the oracle's where it has one."""
    x, y = _batch(4)
    losses, grads = _oracle(model, x, y)
    norms = oracle.per_example_norms(grads)
    reference = np.random.default_rng(5).standard_normal((2, 17, 6))
    options = {
        "clipped_sum": {"max_norm": float(np.sqrt(norms.min() * norms.max()))},
        "dot": {"reference": {"dense/kernel": reference}, "variables": ["dense/kernel"]},
        "project": {"dim": 8},
    }.get(reduction, {})
    with _client(served) as client:
        result = client.per_example_gradients("pair", x, y, reduction=reduction, **options)
        micro = GradientClient(f"127.0.0.1:{served.port}", micro_batch=3)
        with micro:
            merged = micro.per_example_gradients("pair", x, y, reduction=reduction, **options)
    if reduction == "dot":
        grads = {"dense/kernel": grads["dense/kernel"]}
    expected = _expected(reduction, grads, options)
    outputs = CATALOGUE.get(reduction).outputs
    assert set(expected) == {o.field for o in outputs} - {"projections"}
    if reduction == "clipped_sum":
        assert 0 < expected["num_clipped"] < len(y)
    if reduction == "project":
        assert result.projections.shape == (4, 8)
    for either in (result, merged):
        assert_close({"losses": either.losses}, {"losses": losses})
    for output in outputs:
        _same(output, getattr(merged, output.field), getattr(result, output.field))
        if output.field in expected:
            _same(output, getattr(result, output.field), expected[output.field])


@pytest.mark.parametrize(
    ("x", "message"),
    [
        ({"numeric": np.zeros((2, 5))}, "missing ['tokens']"),
        ({"numeric": np.zeros((2, 5)), "tokens": np.zeros((3, 4), int)}, "inputs['tokens']: 3"),
        ({"numeric": np.zeros((2, 5)), "tokens": np.full((2, 4), 30)}, "outside [0, 30)"),
        (np.zeros((2, 5)), "pass a mapping from these names"),
    ],
    ids=["missing input", "batch sizes differ", "ids out of range", "one array"],
)
def test_bad_inputs_are_invalid_naming_the_input(served, x, message: str) -> None:
    with _client(served) as client, pytest.raises(PergradError) as err:
        client.per_example_gradients("pair", x, np.zeros(2, int))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message


def test_pergrad_grads_reads_each_input_by_name(served, tmp_path: Path) -> None:
    x, y = _batch(7, seed=1)
    np.savez(tmp_path / "data.npz", y=y, **x)
    code = cli(
        [
            "grads", "--target", f"127.0.0.1:{served.port}", "--model", "pair",
            "--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / "out.npz"),
            "--batch-size", "3", "--reduction", "norms", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    with _client(served) as client:
        direct = client.per_example_gradients("pair", x, y, reduction="norms")
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["norms"], direct.norms, rtol=1e-6)
