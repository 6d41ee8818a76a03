"""The engine against the Keras-only oracle (tests/oracle.py), on every model the server
ships and more."""

from __future__ import annotations

import re
from typing import Any

import keras
import numpy as np
import pytest

from pergrad.server.engine import Engine
from pergrad.server.engine.compiled import XLA_MARGIN
from pergrad.server.engine.group import Job, shared_rows
from pergrad.server.engine.rules import LayerRegistry
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.results import GradientResult
from tests import oracle
from tests.helpers import assert_close, batch_for, tabular_model
from tests.zoo import FAMILIES


def _model_and_loss(name: str) -> tuple[keras.Model, Any]:
    """A model and the Keras loss it is trained on: the .keras model's compiled one."""
    if name == "tabular":
        model = tabular_model()
        return model, model.loss
    return BUILTIN_MODELS[name](), LOSS


def _engine(name: str, **settings: Any) -> tuple[Engine, Any]:
    """The engine on a fresh model (no XLA unless `settings` say), and the model's loss."""
    model, loss = _model_and_loss(name)
    return Engine(model, loss=loss, **{"jit_compile": False, **settings}), loss


def _batch(engine: Engine, size: int, seed: int = 0):
    return batch_for(engine.input_spec.shape, engine.label_spec.num_classes, size, seed)


MODELS = ["mnist_mlp", "mnist_cnn", "tabular"]


def _check_against_oracle(
    engine: Engine, loss: Any, x: Any, y: Any, weights: dict[str, np.ndarray] | None = None
) -> None:
    """Losses and gradients (keyed by the model's variable paths) equal the oracle's; the
    engine takes `weights` ({path: value}) in model order, as a snapshot holds them."""
    trainable = (
        None if weights is None else [weights[v.path] for v in engine.model.trainable_variables]
    )
    result = engine.per_example_gradients(x, y, trainable=trainable)
    losses, grads = oracle.per_example(engine.model, loss, x, y, weights=weights)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("name", MODELS)
def test_per_example_gradients_match_keras_oracle(name: str, batch_size: int) -> None:
    engine, loss = _engine(name)
    _check_against_oracle(engine, loss, *_batch(engine, batch_size))


@pytest.mark.parametrize("name", MODELS)
def test_mean_of_per_example_gradients_is_keras_batch_gradient(name: str) -> None:
    engine, loss = _engine(name)
    x, y = _batch(engine, 32, seed=1)
    result = engine.per_example_gradients(x, y)
    means = {k: v.mean(axis=0) for k, v in result.gradients.items()}
    assert_close(means, oracle.batch_gradient(engine.model, loss, x, y))


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn"])
def test_slices_give_the_same_result_as_one_pass(name: str) -> None:
    whole, _ = _engine(name)
    sliced = Engine(whole.model, loss=LOSS, slice_bytes=1, jit_compile=False)
    assert sliced.slice_size == 1
    x, y = _batch(whole, 10)
    assert_close(
        sliced.per_example_gradients(x, y).gradients, whole.per_example_gradients(x, y).gradients
    )


def test_blocks_cover_the_batch_in_order() -> None:
    engine, _ = _engine("mnist_mlp")
    x, y = _batch(engine, 10)
    whole = engine.per_example_gradients(x, y)
    bounds = []
    for block in engine.iter_slices(x, y, block_bytes=3 * 101_770 * 4):
        bounds.append((block.start, block.stop))
        blocks = dict(zip(whole.gradients, block.gradients, strict=True))
        assert_close(blocks, {k: v[block.start : block.stop] for k, v in whole.gradients.items()})
    assert bounds == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_out_buffers_are_refilled_in_place() -> None:
    engine, _ = _engine("mnist_mlp")
    x, y = _batch(engine, 6)
    first = engine.per_example_gradients(x, y)
    kernel = first.gradients["hidden/kernel"]
    x2, y2 = _batch(engine, 6, seed=5)
    second = engine.per_example_gradients(x2, y2, out=first)
    assert second is first and second.gradients["hidden/kernel"] is kernel
    assert_close(second.gradients, engine.per_example_gradients(x2, y2).gradients)


def test_given_weights_are_used_instead_of_the_models() -> None:
    engine, loss = _engine("mnist_mlp")
    doubled = {v.path: v.numpy() * 2 for v in engine.model.trainable_variables}
    _check_against_oracle(engine, loss, *_batch(engine, 4), weights=doubled)


def test_each_call_computes_with_the_models_values_of_that_moment() -> None:
    """A trainer updating its model between calls gets gradients at the new values."""
    engine, loss = _engine("mnist_mlp")
    x, y = _batch(engine, 4)
    engine.per_example_gradients(x, y)
    for v in engine.model.trainable_variables:
        v.assign(v.value * 2)
    _, grads = oracle.per_example(engine.model, loss, x, y)
    assert_close(engine.per_example_gradients(x, y).gradients, grads)


def test_each_call_computes_with_the_models_statistics_of_that_moment() -> None:
    """Non-trainable values (batch norm's moving statistics) are read as each pass runs,
    like the trainable ones: a trainer that updates them between calls is heard."""
    model, loss = FAMILIES["cnn_batch_norm"].build()
    engine = Engine(model, loss=loss, jit_compile=False)
    x, y = FAMILIES["cnn_batch_norm"].batch(model, 4)
    engine.per_example_gradients(x, y)
    for v in model.non_trainable_variables:
        v.assign(v.value * 1.5)
    _, grads = oracle.per_example(model, loss, x, y)
    assert_close(engine.per_example_gradients(x, y).gradients, grads)


def test_initial_weights_keep_their_values_when_the_model_changes() -> None:
    """The values read are the server's first snapshot: a later write to the model's
    variables must not reach them."""
    engine, _ = _engine("mnist_mlp")
    read = engine.passes.initial_weights()
    before = [t.numpy().copy() for t in read]
    for v in engine.model.trainable_variables:
        v.assign(v.value + 1)
    for tensor, value in zip(read, before, strict=True):
        np.testing.assert_array_equal(tensor.numpy(), value)


def test_sequence_outputs_average_loss_over_time_steps() -> None:
    inputs = keras.Input((6, 3))
    outputs = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(3))(inputs)
    engine = Engine(keras.Model(inputs, outputs), loss="mean_squared_error", jit_compile=False)
    assert engine.label_spec.shape == (6, 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, 3)).astype(np.float32)
    y = rng.standard_normal((5, 6, 2)).astype(np.float32)
    _check_against_oracle(engine, "mean_squared_error", x, y)


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
    engine, _ = _engine("mnist_mlp")
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.iter_slices(np.zeros(x_shape, x_dtype), y)


def test_numpy_default_dtypes_are_cast_without_loss() -> None:
    """float64 inputs and int64 labels, numpy's defaults, as the client casts them."""
    engine, _ = _engine("mnist_mlp")
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
def test_vectorized_route_alone_matches_keras_oracle(name: str) -> None:
    engine, loss = _engine(name, registry=LayerRegistry())
    assert len(engine.plan.fallback) == len(engine.model.trainable_variables)
    _check_against_oracle(engine, loss, *_batch(engine, 6))


def test_xla_pads_odd_slices_and_drops_the_padding() -> None:
    engine, loss = _engine("transformer_block", jit_compile=True)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1000, size=(5, 32)).astype(np.int32)
    y = rng.integers(0, 10, size=5).astype(np.int32)
    assert engine.per_example_gradients(x, y).losses.shape == (5,)
    _check_against_oracle(engine, loss, x, y)


AUTO_CHOICE = re.compile(r"XLA (on|off): ([\d.]+) ms with, ([\d.]+) ms without, medians of")


def test_auto_jit_keeps_xla_only_where_it_measured_clearly_faster() -> None:
    """mnist_mlp compiles under XLA and is all ruled: "auto" times both and keeps XLA
    exactly when its median is below XLA_MARGIN of the plain graph's (the medians as
    measured: the summary's are rounded to 0.1 ms, too coarse near the margin), and the
    summary says which with the medians."""
    engine, loss = _engine("mnist_mlp", jit_compile="auto")
    assert engine.xla_medians is not None, engine.summary
    with_xla, without = engine.xla_medians
    xla = "on" if with_xla < XLA_MARGIN * without else "off"
    assert engine.plan_text.startswith(f"XLA {xla};"), (engine.xla_medians, engine.summary)
    choice = AUTO_CHOICE.search(engine.summary)
    assert choice and choice.group(1) == xla, engine.summary
    _check_against_oracle(engine, loss, *_batch(engine, 3))


def test_cancelled_work_stops_at_the_next_slice() -> None:
    engine, _ = _engine("mnist_mlp", slice_bytes=1)
    x, y = _batch(engine, 5)
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled, match="stopped after 2 of 5"):
        engine.per_example_gradients(x, y, reduction="norms", cancelled=cancelled)


def _arrays(value: Any) -> list[np.ndarray]:
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    return [value] if isinstance(value, np.ndarray) else []


def _every_reduction(engine: Engine) -> dict[str, dict[str, Any]]:
    """Each reduction of the catalogue with the options it needs."""
    references = {v.name: np.ones((2, *v.shape), np.float32) for v in engine.variables}
    needs = {
        "clipped_sum": {"max_norm": 0.1, "noise_multiplier": 1.0, "seed": 3},
        "dot": {"reference": references},
        "project": {"dim": 4, "seed": 1},
    }
    return {name: needs.get(name, {}) for name in CATALOGUE.names}


def _writeable(result: GradientResult) -> bool:
    arrays = [result.losses, *_arrays(result.outputs)]
    return len(arrays) > 1 and all(a.flags.writeable for a in arrays)


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn"])
def test_every_array_a_result_holds_is_the_callers_to_write(name: str) -> None:
    """The pass's outputs are read as views of TensorFlow's buffers, which must not be
    written: whatever a caller receives, from its own pass or a shared one, is its own
    array, writeable (mnist_cnn adds factors over many positions: its convolutions')."""
    engine, _ = _engine(name)
    x, y = _batch(engine, 3)
    batch = engine.batch(x, y)
    for reduction, options in _every_reduction(engine).items():
        alone = engine.compute(batch, reduction=reduction, **options)
        sink = engine.passes.sink(batch.size, reduction=reduction, **options)
        (rows,) = shared_rows(engine, [Job(batch, sink)], granule=4)
        assert _writeable(alone), reduction
        assert _writeable(rows.into(sink)), reduction


def test_blocks_hold_writeable_losses() -> None:
    engine, _ = _engine("mnist_mlp")
    (block,) = engine.iter_slices(*_batch(engine, 3))
    assert block.losses.flags.writeable
