"""Every closed-form rule against the Keras-only oracle (tests/oracle.py), one layer
configuration per case.

Each case also asserts that the rule, not the vectorized fallback, produced the result.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

from pergrad.server.engine import Engine
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS, PositionEmbedding
from tests import oracle
from tests.helpers import assert_close

L = keras.layers


def _init(seed: int) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(0.0, 0.3, seed=seed)


def _head(h, classes: int = 4):
    if len(h.shape) > 2:
        h = L.Flatten()(h)
    return L.Dense(classes, kernel_initializer=_init(99), name="head")(h)


def _model(input_shape, body: Callable, dtype: str = "float32") -> keras.Model:
    inputs = keras.Input(input_shape, dtype=dtype)
    return keras.Model(inputs, _head(body(inputs)))


def _separable(layer: type, *args, **kwargs) -> Callable:
    """A SeparableConv layer's call, every kernel and bias drawn from its own seed."""
    initializers = {"depthwise_initializer": _init(15), "pointwise_initializer": _init(16)}
    if kwargs.get("use_bias", True):
        initializers["bias_initializer"] = _init(17)
    return layer(*args, **kwargs, **initializers)


CASES: dict[str, Callable[[], keras.Model]] = {
    "dense": lambda: _model((6,), lambda x: L.Dense(5, "tanh", kernel_initializer=_init(1))(x)),
    "dense_on_sequence": lambda: _model(
        (4, 6), lambda x: L.Dense(5, "relu", kernel_initializer=_init(1))(x)
    ),
    "dense_no_bias": lambda: _model(
        (6,), lambda x: L.Dense(5, use_bias=False, kernel_initializer=_init(1))(x)
    ),
    "einsum_dense": lambda: _model(
        (4, 6),
        lambda x: L.EinsumDense(
            "abc,cde->abde", (4, 3, 2), bias_axes="de", kernel_initializer=_init(2)
        )(x),
    ),
    "einsum_dense_ellipsis": lambda: _model(
        (4, 6),
        lambda x: L.EinsumDense(
            "...b,bc->...c", 3, bias_axes="c", kernel_initializer=_init(2), activation="gelu"
        )(x),
    ),
    "conv2d_same_strided": lambda: _model(
        (9, 9, 2),
        lambda x: L.Conv2D(
            3, 3, strides=2, padding="same", activation="relu", kernel_initializer=_init(3)
        )(x),
    ),
    "conv2d_dilated_grouped": lambda: _model(
        (10, 10, 4),
        lambda x: L.Conv2D(6, 3, dilation_rate=2, groups=2, kernel_initializer=_init(3))(x),
    ),
    "conv2d_rectangular_valid": lambda: _model(
        (8, 7, 2), lambda x: L.Conv2D(3, (3, 2), strides=(1, 2), kernel_initializer=_init(3))(x)
    ),
    "conv1d_causal_dilated": lambda: _model(
        (12, 3),
        lambda x: L.Conv1D(4, 3, padding="causal", dilation_rate=2, kernel_initializer=_init(4))(x),
    ),
    "conv1d_same_strided_grouped": lambda: _model(
        (11, 4),
        lambda x: L.Conv1D(4, 3, strides=2, padding="same", groups=2, kernel_initializer=_init(4))(
            x
        ),
    ),
    # Rows of 8 channels or more: patches by unit-stride slices (`patches`).
    "conv2d_same_wide_by_slices": lambda: _model(
        (6, 7, 8),
        lambda x: L.Conv2D(3, 3, padding="same", activation="relu", kernel_initializer=_init(3))(x),
    ),
    "conv2d_window_of_strides_by_slices": lambda: _model(
        (9, 8, 4), lambda x: L.Conv2D(3, 4, strides=2, kernel_initializer=_init(3))(x)
    ),
    "conv1d_same_strided_by_slices": lambda: _model(
        (11, 4), lambda x: L.Conv1D(3, 4, strides=2, padding="same", kernel_initializer=_init(4))(x)
    ),
    "conv2d_grouped_by_slices": lambda: _model(
        (6, 6, 8),
        lambda x: L.Conv2D(4, 3, padding="same", groups=2, kernel_initializer=_init(3))(x),
    ),
    "depthwise_conv2d_by_slices": lambda: _model(
        (6, 6, 8), lambda x: L.DepthwiseConv2D(3, padding="same", depthwise_initializer=_init(5))(x)
    ),
    "depthwise_conv2d": lambda: _model(
        (8, 8, 3),
        lambda x: L.DepthwiseConv2D(
            3, depth_multiplier=2, padding="same", depthwise_initializer=_init(5)
        )(x),
    ),
    "separable_conv2d_strided": lambda: _model(
        (9, 9, 3),
        _separable(
            L.SeparableConv2D,
            4,
            3,
            strides=2,
            padding="same",
            depth_multiplier=2,
            activation="relu",
        ),
    ),
    "separable_conv2d_dilated_no_bias": lambda: _model(
        (10, 10, 2), _separable(L.SeparableConv2D, 3, (3, 2), dilation_rate=2, use_bias=False)
    ),
    "separable_conv1d": lambda: _model(
        (12, 3), _separable(L.SeparableConv1D, 4, 3, depth_multiplier=3, activation="tanh")
    ),
    "embedding": lambda: _model(
        (7,), lambda x: L.Embedding(20, 4, embeddings_initializer=_init(6))(x), dtype="int32"
    ),
    "layer_norm": lambda: _model(
        (4, 6),
        lambda x: L.LayerNormalization(gamma_initializer=_init(7), beta_initializer=_init(8))(
            L.Dense(6)(x)
        ),
    ),
    "batch_norm_inference": lambda: _model(
        (5, 5, 3), lambda x: _batch_norm()(L.Conv2D(3, 2, kernel_initializer=_init(3))(x))
    ),
    "layers_without_variables": lambda: _model(
        (8, 8, 2),
        lambda x: L.Dropout(0.5)(
            L.GlobalAveragePooling2D()(
                L.AveragePooling2D(2)(L.ReLU()(L.Conv2D(3, 3, kernel_initializer=_init(3))(x)))
            )
        ),
    ),
    "shared_dense_called_twice": lambda: _shared_dense(),
    "lstm": lambda: _text(lambda h: L.LSTM(5, **_recurrent(20))(h)),
    "lstm_over_features": lambda: _model((6, 3), lambda x: L.LSTM(4, **_recurrent(21))(x)),
    "lstm_masked_sequences": lambda: _text(
        lambda h: L.LSTM(4, return_sequences=True, **_recurrent(22))(h), mask_zero=True
    ),
    "gru_sequences_pooled": lambda: _text(
        lambda h: L.GlobalAveragePooling1D()(L.GRU(5, return_sequences=True, **_recurrent(23))(h))
    ),
    "gru_masked": lambda: _text(lambda h: L.GRU(4, **_recurrent(24))(h), mask_zero=True),
    "simple_rnn_backwards": lambda: _text(
        lambda h: L.SimpleRNN(5, go_backwards=True, **_recurrent(25))(h)
    ),
    "bidirectional_lstm": lambda: _text(
        lambda h: L.Bidirectional(L.LSTM(3, return_sequences=True, **_recurrent(26)))(h)
    ),
    "stacked_gru_lstm": lambda: _text(
        lambda h: L.LSTM(3, **_recurrent(28))(L.GRU(4, return_sequences=True, **_recurrent(27))(h))
    ),
    "lstm_return_state": lambda: _text(
        lambda h: L.Concatenate()(L.LSTM(3, return_state=True, **_recurrent(29))(h))
    ),
    "position_embedding": lambda: _model((5, 3), lambda x: PositionEmbedding(_init(9))(x)),
    "rms_normalization": lambda: _model(
        (4, 6), lambda x: _scaled(L.RMSNormalization(epsilon=1e-3))(L.Dense(6)(x))
    ),
    "layer_norm_rms_scaling": lambda: _model(
        (4, 6), lambda x: _scaled(L.LayerNormalization(rms_scaling=True))(L.Dense(6)(x))
    ),
    "rms_norm_found_by_probe": lambda: _model(
        (4, 6), lambda x: _scaled(GemmaStyleNorm(name="gemma_norm"))(L.Dense(6)(x))
    ),
    "dense_lora": lambda: _model(
        (4, 6), lambda x: _lora(L.Dense(5, "tanh", kernel_initializer=_init(1)))(x)
    ),
    "einsum_dense_lora": lambda: _model(
        (4, 6),
        lambda x: _lora(
            L.EinsumDense("abc,cde->abde", (4, 3, 2), bias_axes="de", kernel_initializer=_init(2))
        )(x),
    ),
    # The kernel [n, d, h] interleaves the input's axis with the output's (Gemma's query):
    # its per-example gradient is formed, and LoRA's from it.
    "einsum_dense_interleaved_lora": lambda: _model(
        (4, 6),
        lambda x: _lora(L.EinsumDense("btd,ndh->btnh", (4, 3, 2), kernel_initializer=_init(2)))(x),
    ),
    "reversible_embedding_untied": lambda: _model(
        (7,),
        _projected(
            L.ReversibleEmbedding(20, 4, tie_weights=False, embeddings_initializer=_init(6))
        ),
        dtype="int32",
    ),
    "reversible_embedding_tied_soft_cap": lambda: _model(
        (7,),
        _projected(
            L.ReversibleEmbedding(20, 4, logit_soft_cap=2.0, embeddings_initializer=_init(6))
        ),
        dtype="int32",
    ),
}


class GemmaStyleNorm(L.Layer):
    """x / sqrt(mean(x^2) + eps) * (1 + scale), as keras-hub's Gemma computes it: a class
    no rule names, found by the RMS-norm rule's probe."""

    def __init__(self, epsilon: float = 1e-6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape) -> None:
        self.scale = self.add_weight(shape=input_shape[-1:], initializer="zeros", name="scale")

    def call(self, x):
        mean_square = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return x * keras.ops.rsqrt(mean_square + self.epsilon) * (1 + self.scale)


class CenteredNorm(GemmaStyleNorm):
    """One vector and an epsilon, but centred first: no RMS normalization."""

    def call(self, x):
        return super().call(x - keras.ops.mean(x, axis=-1, keepdims=True))


def _scaled(layer: L.Layer) -> Callable:
    """The layer's call, its one vector (a scale) set at random once built."""

    def call(x):
        out = layer(x)
        variable = layer.trainable_variables[0]
        variable.assign(np.random.default_rng(31).normal(0.5, 0.4, variable.shape))
        return out

    return call


def _lora(layer: L.Layer) -> Callable:
    """The layer's call, with LoRA of rank 2 and both factors random (B starts at zero,
    where A's gradient vanishes)."""

    def call(x):
        layer(x)  # builds it
        layer.enable_lora(2, lora_alpha=3)
        rng = np.random.default_rng(32)
        for factor in (layer.lora_kernel_a, layer.lora_kernel_b):
            factor.assign(rng.normal(0.0, 0.5, factor.shape))
        return layer(x)

    return call


def _projected(embedding: L.ReversibleEmbedding) -> Callable:
    """Token ids looked up, a Dense, then the same table in reverse: logits over the
    vocabulary at every step (a causal LM's shape), flattened into the head."""
    return lambda ids: embedding(
        L.Dense(4, "tanh", kernel_initializer=_init(1))(embedding(ids)), reverse=True
    )


def _recurrent(seed: int) -> dict:
    """Seeded kernels and non-zero biases for a recurrent layer."""
    return {
        "kernel_initializer": _init(seed),
        "recurrent_initializer": _init(seed + 100),
        "bias_initializer": keras.initializers.RandomNormal(0.0, 0.3, seed=seed + 200),
    }


def _text(body: Callable, *, mask_zero: bool = False) -> keras.Model:
    """Token ids [B, 7] in [0, 20) -> embeddings -> body -> head."""
    embedded = lambda x: L.Embedding(20, 4, embeddings_initializer=_init(6), mask_zero=mask_zero)(x)  # noqa: E731
    return _model((7,), lambda x: body(embedded(x)), dtype="int32")


def _batch_norm() -> keras.layers.BatchNormalization:
    """Non-trivial moving statistics (means around 0, variances in [0.5, 2]), so the rule
    must use both."""
    return L.BatchNormalization(
        moving_mean_initializer=_init(10),
        moving_variance_initializer=keras.initializers.RandomUniform(0.5, 2.0, seed=14),
        gamma_initializer=_init(11),
        beta_initializer=_init(12),
    )


def _shared_dense() -> keras.Model:
    inputs = keras.Input((6,))
    shared = L.Dense(6, "tanh", kernel_initializer=_init(1))
    return keras.Model(inputs, _head(shared(shared(inputs))))


def _inputs(model: keras.Model, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (batch, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype == "int32":
        x = rng.integers(0, 20, size=shape).astype(np.int32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.integers(0, 4, size=batch).astype(np.int32)


def _check_against_oracle(engine: Engine, x: np.ndarray, y: np.ndarray) -> None:
    """Losses and gradients (keyed by the model's variable paths) equal the oracle's."""
    result = engine.per_example_gradients(x, y)
    losses, grads = oracle.per_example(engine.model, LOSS, x, y)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


def _check_random_batch(engine: Engine, batch: int = 5) -> None:
    _check_against_oracle(engine, *_inputs(engine.model, batch))


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_matches_keras_oracle(case: str) -> None:
    engine = Engine(CASES[case](), loss=LOSS, jit_compile=False)
    assert engine.plan.fallback == (), engine.plan.describe()
    _check_random_batch(engine)


@pytest.mark.parametrize("name", ["transformer_block", "wide_mlp"])
def test_builtin_model_matches_keras_oracle(name: str) -> None:
    engine = Engine(BUILTIN_MODELS[name](), loss=LOSS, jit_compile=False)
    assert engine.plan.fallback == ()
    x, y = _inputs(engine.model, 3)
    if name == "transformer_block":
        x = np.random.default_rng(1).integers(0, 1000, size=(3, 32)).astype(np.int32)
    _check_against_oracle(engine, x, y)


class Scale(L.Layer):
    """A layer no rule knows: its variable must take the vectorized route."""

    def build(self, input_shape) -> None:
        self.scale = self.add_weight(shape=input_shape[-1:], initializer=_init(13), name="scale")

    def call(self, inputs):
        return inputs * self.scale


def test_model_mixing_ruled_and_unruled_layers() -> None:
    inputs = keras.Input((6,))
    h = L.Dense(5, "relu", kernel_initializer=_init(1), name="ruled")(inputs)
    h = Scale(name="unruled")(h)
    model = keras.Model(inputs, _head(h))
    engine = Engine(model, loss=LOSS, jit_compile=False)
    assert [model.trainable_variables[i].path for i in engine.plan.fallback] == ["unruled/scale"]
    assert "vectorized fallback: unruled (no rule for Scale)" in engine.plan.describe()
    _check_random_batch(engine)


def test_a_vector_layer_that_is_no_rms_norm_takes_the_generic_route() -> None:
    """The RMS-norm rule's probe takes a layer by what it computes, not by its shape."""
    inputs = keras.Input((4, 6))
    h = _scaled(CenteredNorm(name="centered"))(L.Dense(6, kernel_initializer=_init(1))(inputs))
    engine = Engine(keras.Model(inputs, _head(h)), loss=LOSS, jit_compile=False)
    assert [engine.model.trainable_variables[i].path for i in engine.plan.fallback] == [
        "centered/scale"
    ]
    assert "centered (no rule for CenteredNorm (it holds one vector" in engine.plan.describe()
    _check_random_batch(engine)


def test_conv1d_text_model() -> None:
    tokens = keras.Input((16,), dtype="int32")
    h = L.Embedding(20, 8, embeddings_initializer=_init(6))(tokens)
    h = L.Conv1D(6, 3, padding="same", activation="relu", kernel_initializer=_init(4))(h)
    h = L.GlobalMaxPooling1D()(h)
    engine = Engine(keras.Model(tokens, _head(h)), loss=LOSS, jit_compile=False)
    assert engine.plan.fallback == ()
    _check_random_batch(engine, batch=7)


def test_nested_sequential_inside_functional() -> None:
    block = keras.Sequential(
        [
            L.Conv2D(3, 3, kernel_initializer=_init(3)),
            L.LayerNormalization(),
            L.Flatten(),
            L.Dense(4, "relu", kernel_initializer=_init(1)),
        ]
    )
    inputs = keras.Input((6, 6, 1))
    engine = Engine(keras.Model(inputs, _head(block(inputs))), loss=LOSS, jit_compile=False)
    assert engine.plan.fallback == ()
    _check_random_batch(engine)


def test_capturing_leaves_the_model_unchanged() -> None:
    model = CASES["dense"]()
    x, _ = _inputs(model, 3)
    before = np.asarray(model(x))
    Engine(model, loss=LOSS, jit_compile=False)
    assert "call" not in vars(model.layers[1])
    np.testing.assert_array_equal(np.asarray(model(x)), before)


@pytest.mark.parametrize(
    "case",
    [
        "conv2d_dilated_grouped",
        "separable_conv2d_strided",
        "embedding",
        "layer_norm",
        "dense",
        "reversible_embedding_tied_soft_cap",
        "einsum_dense_lora",
        "rms_norm_found_by_probe",
    ],
)
def test_xla_compiled_rule_matches_keras_oracle(case: str) -> None:
    engine = Engine(CASES[case](), loss=LOSS, jit_compile=True)
    assert "XLA on" in engine.summary
    _check_random_batch(engine, batch=5)


@pytest.mark.parametrize(
    "case",
    [
        "lstm",
        "gru_sequences_pooled",
        "simple_rnn_backwards",
        "bidirectional_lstm",
        "stacked_gru_lstm",
    ],
)
def test_recurrent_models_in_auto_mode_match_keras_oracle(case: str) -> None:
    engine = Engine(CASES[case](), loss=LOSS, jit_compile="auto")
    assert engine.plan.fallback == (), engine.plan.describe()
    _check_random_batch(engine, batch=5)


def test_auto_mode_runs_without_xla_where_xla_cannot_compile() -> None:
    """A recurrent layer over sequences of any length has no rule (no fixed time axis):
    its vectorized route holds a while loop XLA cannot compile, so "auto" runs it without."""
    tokens = keras.Input((None,), dtype="int32")
    h = L.Embedding(20, 4, embeddings_initializer=_init(6))(tokens)
    model = keras.Model(tokens, _head(L.LSTM(3, name="lstm", **_recurrent(30))(h)))
    engine = Engine(model, loss=LOSS, jit_compile="auto")
    assert engine.plan.describe().endswith(
        "vectorized fallback: lstm (LSTM over a time axis of unknown length)"
    )
    assert "XLA off: it cannot compile this model" in engine.summary
    x = np.random.default_rng(3).integers(0, 20, size=(4, 9)).astype(np.int32)
    _check_against_oracle(engine, x, np.arange(4, dtype=np.int32) % 4)
