"""Models of several inputs end to end: ModelInfo lists them, the client takes a mapping
or a list, the server checks every input, `pergrad grads` reads them from the .npz by
name, and every reduction works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest

from pergrad.cli import main as cli
from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from pergrad.wire.catalogue import CATALOGUE
from tests.helpers import loopback_config

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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("several")
    _two_inputs().save(directory / "pair.keras")
    running = start(loopback_config("pair.keras", model_dir=directory))
    yield running
    running.stop(0)


def _batch(size: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {"numeric": rng.standard_normal((size, 5)), "tokens": rng.integers(0, 30, (size, 4))}
    return x, rng.integers(0, 3, size)


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


@pytest.mark.parametrize("reduction", CATALOGUE.names)
def test_every_reduction_takes_several_inputs(served, reduction: str) -> None:
    x, y = _batch(4)
    options = {
        "clipped_sum": {"max_norm": 1.0},
        "dot": {"reference": {"dense/kernel": np.ones((2, 17, 6))}, "variables": ["dense/kernel"]},
        "project": {"dim": 8},
    }.get(reduction, {})
    with _client(served) as client:
        result = client.per_example_gradients("pair", x, y, reduction=reduction, **options)
        micro = GradientClient(f"127.0.0.1:{served.port}", micro_batch=3)
        with micro:
            merged = micro.per_example_gradients("pair", x, y, reduction=reduction, **options)
    np.testing.assert_allclose(merged.losses, result.losses, rtol=1e-6)


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
