"""pergrad's per-example losses against formulas written out in numpy (float64).

An example's loss is the Keras loss of that example alone: the loss's values for it
averaged over every axis after the batch (classes of a multi-label loss, time steps of
a sequence). Each kind of loss is checked as a Loss object, by name and as a serialized
config where Keras has them, on small random tensors; then the engine's losses and
per-example gradients of a linear model, whose gradients have a closed form too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.engine import Engine
from pergrad.server.engine.losses import PerExampleLoss

B, C, T, F = 5, 4, 3, 6
RTOL = 1e-5


# ---- formulas ------------------------------------------------------------------------


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def softmax(z: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(z))


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def one_hot(labels: np.ndarray, count: int) -> np.ndarray:
    return np.eye(count)[labels]


def mean_after_batch(values: np.ndarray) -> np.ndarray:
    return values.reshape(len(values), -1).mean(axis=1)


def sparse_ce_logits(y, z):
    return mean_after_batch(-np.take_along_axis(log_softmax(z), y[..., None], axis=-1)[..., 0])


def sparse_ce_probs(y, p):
    return mean_after_batch(-np.log(np.take_along_axis(p, y[..., None], axis=-1)[..., 0]))


IGNORED = 2  # a class index the loss skips: the example's mean runs over the other steps


def sparse_ce_ignoring(y, z):
    values = -np.take_along_axis(log_softmax(z), y[..., None], axis=-1)[..., 0]
    kept = (y != IGNORED).reshape(len(y), -1)
    return np.sum(values.reshape(len(y), -1) * kept, axis=1) / np.maximum(kept.sum(axis=1), 1)


def ce_logits(y, z):
    return mean_after_batch(-np.sum(y * log_softmax(z), axis=-1))


def ce_probs(y, p):
    return mean_after_batch(-np.sum(y * np.log(p), axis=-1))


def bce_logits(y, z):
    # log(1 + e^-z) for y = 1, log(1 + e^z) for y = 0, written without overflow
    return mean_after_batch(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))


def bce_probs(y, p):
    return mean_after_batch(-(y * np.log(p) + (1 - y) * np.log(1 - p)))


def mse(y, p):
    return mean_after_batch((p - y) ** 2)


def mae(y, p):
    return mean_after_batch(np.abs(p - y))


def huber(delta: float):
    def formula(y, p):
        error = np.abs(p - y)
        return mean_after_batch(
            np.where(error <= delta, 0.5 * error**2, delta * error - 0.5 * delta**2)
        )

    return formula


WEIGHTS = np.array([1.0, 2.0, 0.5, 3.0])


def cubic_per_value(y_true, y_pred):
    """A custom loss of one value per output element: [B, C]."""
    return tf.abs(y_pred - y_true) ** 3 * tf.constant(WEIGHTS, y_pred.dtype)


def cubic_per_value_np(y, p):
    return mean_after_batch(np.abs(p - y) ** 3 * WEIGHTS)


def cubic_per_example(y_true, y_pred):
    """A custom loss of one value per example: [B]."""
    return tf.reduce_sum(tf.abs(y_pred - y_true) ** 3, axis=-1)


def cubic_per_example_np(y, p):
    return np.sum(np.abs(p - y) ** 3, axis=-1)


# ---- data ----------------------------------------------------------------------------


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(array: np.ndarray) -> np.ndarray:
    """float32, as the model computes; formulas then take these values in float64."""
    return array.astype(np.float32)


LOGITS = _f32(2.0 * _rng(1).standard_normal((B, C)))
PROBS = _f32(softmax(LOGITS.astype(np.float64)))
SIGMOIDS = _f32(sigmoid(LOGITS.astype(np.float64)))
CLASSES = _rng(2).integers(0, C, size=B).astype(np.int32)
ONE_HOT = _f32(one_hot(CLASSES, C))
MULTI_HOT = _f32(_rng(3).integers(0, 2, size=(B, C)))
TARGETS = _f32(1.5 * _rng(4).standard_normal((B, C)))
SEQUENCE_LOGITS = _f32(2.0 * _rng(5).standard_normal((B, T, C)))
SEQUENCE_CLASSES = _rng(6).integers(0, C, size=(B, T)).astype(np.int32)
SEQUENCE_TARGETS = _f32(_rng(7).standard_normal((B, T, C)))


def _specs(loss: keras.losses.Loss, *names: str) -> list[Any]:
    """The loss as an object, as its serialized config, and by the names given."""
    return [loss, keras.losses.serialize(loss), *names]


# (loss specs, labels, outputs, formula)
CASES: dict[str, tuple[list[Any], np.ndarray, np.ndarray, Callable]] = {
    "sparse_ce_logits": (
        _specs(keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        CLASSES,
        LOGITS,
        sparse_ce_logits,
    ),
    "sparse_ce_probs": (
        _specs(keras.losses.SparseCategoricalCrossentropy(), "sparse_categorical_crossentropy"),
        CLASSES,
        PROBS,
        sparse_ce_probs,
    ),
    "ce_logits": (
        _specs(keras.losses.CategoricalCrossentropy(from_logits=True)),
        ONE_HOT,
        LOGITS,
        ce_logits,
    ),
    "ce_probs": (
        _specs(keras.losses.CategoricalCrossentropy(), "categorical_crossentropy"),
        ONE_HOT,
        PROBS,
        ce_probs,
    ),
    "bce_multi_label_logits": (
        _specs(keras.losses.BinaryCrossentropy(from_logits=True)),
        MULTI_HOT,
        LOGITS,
        bce_logits,
    ),
    "bce_multi_label_probs": (
        _specs(keras.losses.BinaryCrossentropy(), "binary_crossentropy"),
        MULTI_HOT,
        SIGMOIDS,
        bce_probs,
    ),
    "mse": (
        _specs(keras.losses.MeanSquaredError(), "mse", "mean_squared_error"),
        TARGETS,
        LOGITS,
        mse,
    ),
    "mae": (
        _specs(keras.losses.MeanAbsoluteError(), "mae", "mean_absolute_error"),
        TARGETS,
        LOGITS,
        mae,
    ),
    "huber_delta_1": (_specs(keras.losses.Huber(), "huber"), TARGETS, LOGITS, huber(1.0)),
    # Not as a config: Keras 3.15's Huber.get_config() leaves out delta, so a serialized
    # Huber(delta=0.3) comes back as Huber(delta=1.0) whoever deserializes it.
    "huber_delta_0.3": ([keras.losses.Huber(delta=0.3)], TARGETS, LOGITS, huber(0.3)),
    "huber_delta_2.5": ([keras.losses.Huber(delta=2.5)], TARGETS, LOGITS, huber(2.5)),
    "sequence_sparse_ce_logits": (
        _specs(keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        SEQUENCE_CLASSES,
        SEQUENCE_LOGITS,
        sparse_ce_logits,
    ),
    "sequence_sparse_ce_ignore_class": (
        _specs(keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=IGNORED)),
        SEQUENCE_CLASSES,
        SEQUENCE_LOGITS,
        sparse_ce_ignoring,
    ),
    "sequence_mse": (
        _specs(keras.losses.MeanSquaredError(), "mse"),
        SEQUENCE_TARGETS,
        SEQUENCE_LOGITS,
        mse,
    ),
    "custom_per_value": ([cubic_per_value], TARGETS, LOGITS, cubic_per_value_np),
    "custom_per_example": ([cubic_per_example], TARGETS, LOGITS, cubic_per_example_np),
}

PARAMS = [
    pytest.param(case, spec, id=f"{case}-{i}")
    for case, (specs, *_) in CASES.items()
    for i, spec in enumerate(specs)
]


@pytest.mark.parametrize(("case", "spec"), PARAMS)
def test_per_example_loss_matches_formula(case: str, spec: Any) -> None:
    _, labels, outputs, formula = CASES[case]
    got = PerExampleLoss(spec)(tf.constant(labels), tf.constant(outputs)).numpy()
    want = formula(
        labels.astype(np.float64) if labels.dtype.kind == "f" else labels,
        outputs.astype(np.float64),
    )
    assert got.shape == (B,)
    np.testing.assert_allclose(got, want, rtol=RTOL)


def test_data_reach_every_branch_of_the_formulas() -> None:
    """Each Huber delta has errors below and above it; the ignored class takes some of an
    example's steps, never all, and some examples have none."""
    errors = np.abs(LOGITS - TARGETS)
    for delta in (1.0, 0.3, 2.5):
        assert (errors < delta).any() and (errors > delta).any()
    ignored = (SEQUENCE_CLASSES == IGNORED).sum(axis=1)
    assert ignored.max() > 0 and ignored.min() == 0 and ignored.max() < T


def test_sequence_labels_are_class_indices_per_step() -> None:
    spec = PerExampleLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)).label_spec(
        (None, T, C), "float32"
    )
    assert (spec.dtype, spec.shape, spec.num_classes) == (np.dtype("int32"), (T,), C)
    spec = PerExampleLoss("mse").label_spec((None, T, C), "float32")
    assert (spec.dtype, spec.shape) == (np.dtype("float32"), (T, C))


# ---- the engine on a linear model: losses and gradients in closed form ----------------


def _linear(
    input_shape: tuple[int, ...], seed: int = 8
) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """z = x W + b (on every step of a sequence), with known W and b."""
    inputs = keras.Input(input_shape)
    layer = keras.layers.Dense(C, name="linear")
    model = keras.Model(inputs, layer(inputs))
    kernel = _f32(0.5 * _rng(seed).standard_normal((F, C)))
    bias = _f32(0.2 * _rng(seed + 1).standard_normal(C))
    layer.kernel.assign(kernel)
    layer.bias.assign(bias)
    return model, kernel.astype(np.float64), bias.astype(np.float64)


def _sparse_grad(y, z):
    return (softmax(z) - one_hot(y, C)) / _steps(z)


def _steps(z: np.ndarray) -> int:
    return int(np.prod(z.shape[1:-1]))


# (loss, labels(z shape), d loss / d z, formula); every loss on logits z
ENGINE_CASES: dict[str, tuple[Any, Callable[[tuple[int, ...]], np.ndarray], Callable, Callable]] = {
    "sparse_ce_logits": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda shape: _rng(10).integers(0, C, size=shape[:-1]).astype(np.int32),
        _sparse_grad,
        sparse_ce_logits,
    ),
    "ce_logits": (
        keras.losses.CategoricalCrossentropy(from_logits=True),
        lambda shape: _f32(one_hot(_rng(11).integers(0, C, size=shape[0]), C)),
        lambda y, z: softmax(z) - y,
        ce_logits,
    ),
    "bce_logits": (
        keras.losses.BinaryCrossentropy(from_logits=True),
        lambda shape: _f32(_rng(12).integers(0, 2, size=shape)),
        lambda y, z: (sigmoid(z) - y) / C,
        bce_logits,
    ),
    "mse": (
        "mse",
        lambda shape: _f32(_rng(13).standard_normal(shape)),
        lambda y, z: 2 * (z - y) / C,
        mse,
    ),
    "mae": (
        keras.losses.MeanAbsoluteError(),
        lambda shape: _f32(_rng(14).standard_normal(shape)),
        lambda y, z: np.sign(z - y) / C,
        mae,
    ),
    "huber_0.3": (
        keras.losses.Huber(delta=0.3),
        lambda shape: _f32(_rng(15).standard_normal(shape)),
        lambda y, z: np.clip(z - y, -0.3, 0.3) / C,
        huber(0.3),
    ),
    "custom_per_value": (
        cubic_per_value,
        lambda shape: _f32(_rng(16).standard_normal(shape)),
        lambda y, z: 3 * (z - y) * np.abs(z - y) * WEIGHTS / C,
        cubic_per_value_np,
    ),
    "sequence_sparse_ce_logits": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda shape: _rng(17).integers(0, C, size=shape[:-1]).astype(np.int32),
        _sparse_grad,
        sparse_ce_logits,
    ),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_losses_and_gradients_of_a_linear_model(case: str) -> None:
    loss, make_labels, dz, formula = ENGINE_CASES[case]
    input_shape = (T, F) if case.startswith("sequence") else (F,)
    model, kernel, bias = _linear(input_shape)
    x = _f32(_rng(9).standard_normal((B, *input_shape)))
    z = x.astype(np.float64) @ kernel + bias
    y = make_labels(z.shape)
    labels = y.astype(np.float64) if y.dtype.kind == "f" else y

    result = Engine(model, loss=loss, jit_compile=False).per_example_gradients(x, y)

    np.testing.assert_allclose(result.losses, formula(labels, z), rtol=RTOL)
    g = dz(labels, z)  # d loss_b / d z_b, [B, (T,) C]
    steps_x, steps_g = x.reshape(B, -1, F).astype(np.float64), g.reshape(B, -1, C)
    want_kernel = np.einsum("btf,btc->bfc", steps_x, steps_g)
    want_bias = steps_g.sum(axis=1)
    for got, want in (
        (result.gradients["linear/kernel"], want_kernel),
        (result.gradients["linear/bias"], want_bias),
    ):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


# ---- a loss of one value for the whole batch is refused -------------------------------


def mean_over_batch(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_pred - y_true))


class BatchMean(keras.losses.Loss):
    """A Loss whose `call` already averages over the batch."""

    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - y_true))


@pytest.mark.parametrize("loss", [mean_over_batch, BatchMean()], ids=["function", "loss_class"])
def test_loss_of_one_value_per_batch_is_refused(loss: Any) -> None:
    model, _, _ = _linear((F,))
    with pytest.raises(ValueError, match="one value for the whole batch"):
        Engine(model, loss=loss, jit_compile=False)
    with pytest.raises(ValueError, match="one value for the whole batch"):
        PerExampleLoss(loss)(tf.constant(TARGETS), tf.constant(LOGITS))
