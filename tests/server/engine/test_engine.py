"""The engine against the batch-size-1 loop, on every model the server ships and more."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pergrad.server.engine import Engine
from pergrad.server.engine.reference import References
from pergrad.server.engine.rules import LayerRegistry
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from tests.helpers import assert_close, batch_for, tabular_model


def _engine(name: str) -> Engine:
    if name == "tabular":
        return Engine(tabular_model(), jit_compile=False)
    return Engine(BUILTIN_MODELS[name](), loss=LOSS, jit_compile=False)


def _batch(engine: Engine, size: int, seed: int = 0):
    return batch_for(engine.input_spec.shape, engine.label_spec.num_classes, size, seed)


MODELS = ["mnist_mlp", "mnist_cnn", "tabular"]


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("name", MODELS)
def test_per_example_gradients_match_batch_size_one_loop(name: str, batch_size: int) -> None:
    engine = _engine(name)
    x, y = _batch(engine, batch_size)
    result = engine.per_example_gradients(x, y)
    losses, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


@pytest.mark.parametrize("name", MODELS)
def test_mean_of_per_example_gradients_is_batch_gradient(name: str) -> None:
    engine = _engine(name)
    x, y = _batch(engine, 32, seed=1)
    result = engine.per_example_gradients(x, y)
    _, mean_grads = References(engine.model, engine.loss).mean_gradient(x, y)
    means = {k: v.mean(axis=0) for k, v in result.gradients.items()}
    assert_close(means, dict(zip(means, mean_grads, strict=True)))


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn"])
def test_slices_give_the_same_result_as_one_pass(name: str) -> None:
    whole = _engine(name)
    sliced = Engine(whole.model, loss=LOSS, slice_bytes=1, jit_compile=False)
    assert sliced.slice_size == 1
    x, y = _batch(whole, 10)
    assert_close(
        sliced.per_example_gradients(x, y).gradients, whole.per_example_gradients(x, y).gradients
    )


def test_blocks_cover_the_batch_in_order() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, 10)
    whole = engine.per_example_gradients(x, y)
    bounds = []
    for block in engine.iter_slices(x, y, block_bytes=3 * 101_770 * 4):
        bounds.append((block.start, block.stop))
        blocks = dict(zip(whole.gradients, block.gradients, strict=True))
        assert_close(blocks, {k: v[block.start : block.stop] for k, v in whole.gradients.items()})
    assert bounds == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_out_buffers_are_refilled_in_place() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, 6)
    first = engine.per_example_gradients(x, y)
    kernel = first.gradients["hidden/kernel"]
    x2, y2 = _batch(engine, 6, seed=5)
    second = engine.per_example_gradients(x2, y2, out=first)
    assert second is first and second.gradients["hidden/kernel"] is kernel
    assert_close(second.gradients, engine.per_example_gradients(x2, y2).gradients)


def test_given_weights_are_used_instead_of_the_models() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, 4)
    doubled = [w * 2 for w in engine.initial_weights()]
    result = engine.per_example_gradients(x, y, trainable=doubled)
    _, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y, trainable=doubled)
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


def test_sequence_outputs_average_loss_over_time_steps() -> None:
    inputs = keras.Input((6, 3))
    outputs = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(3))(inputs)
    engine = Engine(keras.Model(inputs, outputs), loss="mean_squared_error", jit_compile=False)
    assert engine.label_spec.shape == (6, 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, 3)).astype(np.float32)
    y = rng.standard_normal((5, 6, 2)).astype(np.float32)
    result = engine.per_example_gradients(x, y)
    losses, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y)
    assert_close({"l": result.losses}, {"l": losses})
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


@pytest.mark.parametrize(
    ("x_shape", "x_dtype", "y", "message"),
    [
        ((0, 784), np.float32, np.zeros(0, np.int32), "empty batch"),
        ((2, 783), np.float32, np.zeros(2, np.int32), "shape [2, 783]"),
        ((2, 784), np.float32, np.zeros(2, np.float32), "labels: model expects int32"),
        ((2, 784), np.float32, np.array([0, 2**40]), "labels: values outside the range"),
        ((2, 784), np.float32, np.zeros(3, np.int32), "labels: shape [3]"),
        ((2, 784), np.float32, np.array([0, 10], np.int32), "class index 10"),
        ((2, 784), np.float32, np.array([-1, 0], np.int32), "class index -1"),
    ],
)
def test_bad_batches_are_refused_naming_the_problem(x_shape, x_dtype, y, message) -> None:
    engine = _engine("mnist_mlp")
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.iter_slices(np.zeros(x_shape, x_dtype), y)


def test_numpy_default_dtypes_are_cast_without_loss() -> None:
    """float64 inputs and int64 labels, numpy's defaults, as the client casts them."""
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, 3)
    cast = engine.per_example_gradients(np.asfortranarray(x.astype(np.float64)), y.astype(int))
    exact = engine.per_example_gradients(x, y)
    assert cast.gradients.keys() == exact.gradients.keys()
    for name, grad in exact.gradients.items():
        np.testing.assert_array_equal(cast.gradients[name], grad)


def test_model_without_loss_is_refused() -> None:
    inputs = keras.Input((3,))
    with pytest.raises(ValueError, match="no compiled loss"):
        Engine(keras.Model(inputs, keras.layers.Dense(2)(inputs)))


@pytest.mark.parametrize("name", MODELS)
def test_vectorized_route_alone_matches_batch_size_one_loop(name: str) -> None:
    model = _engine(name).model
    engine = Engine(
        model,
        loss=model.loss if name == "tabular" else LOSS,
        registry=LayerRegistry(),
        jit_compile=False,
    )
    assert len(engine.plan.fallback) == len(model.trainable_variables)
    x, y = _batch(engine, 6)
    result = engine.per_example_gradients(x, y)
    _, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y)
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


def test_xla_pads_odd_slices_and_drops_the_padding() -> None:
    engine = Engine(BUILTIN_MODELS["transformer_block"](), loss=LOSS, jit_compile=True)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1000, size=(5, 32)).astype(np.int32)
    y = rng.integers(0, 10, size=5).astype(np.int32)
    result = engine.per_example_gradients(x, y)
    losses, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y)
    assert result.losses.shape == (5,)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


def test_auto_jit_picks_a_route_and_stays_correct() -> None:
    engine = Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, jit_compile="auto")
    x, y = _batch(engine, 3)
    _, grads = References(engine.model, engine.loss).batch_size_one_loop(x, y)
    result = engine.per_example_gradients(x, y)
    assert_close(result.gradients, dict(zip(result.gradients, grads, strict=True)))


def test_cancelled_work_stops_at_the_next_slice() -> None:
    engine = Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, slice_bytes=1, jit_compile=False)
    x, y = _batch(engine, 5)
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled, match="stopped after 2 of 5"):
        engine.per_example_gradients(x, y, reduction="norms", cancelled=cancelled)
