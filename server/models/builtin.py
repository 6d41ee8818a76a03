"""Built-in models, initialised deterministically (fixed seeds, no download)."""

from __future__ import annotations

from collections.abc import Callable

import keras

from pergrad.server.engine.layers import PositionEmbedding

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class _Seeds:
    """Distinct fixed seeds for each initializer of one model, in construction order."""

    def __init__(self, base: int) -> None:
        self._next = base

    def glorot(self) -> keras.initializers.Initializer:
        self._next += 1
        return keras.initializers.GlorotUniform(seed=self._next)


def _dense(
    seeds: _Seeds, units: int, name: str, activation: str | None = None
) -> keras.layers.Dense:
    return keras.layers.Dense(
        units, activation=activation, kernel_initializer=seeds.glorot(), name=name
    )


def _conv(seeds: _Seeds, filters: int, size: int, *, stride: int, padding: str, name: str):
    return keras.layers.Conv2D(
        filters,
        size,
        strides=stride,
        padding=padding,
        activation="relu",
        kernel_initializer=seeds.glorot(),
        name=name,
    )


def mnist_mlp() -> keras.Model:
    """[B, 784] float32 -> Dense 128 relu -> Dense 10 logits."""
    seeds = _Seeds(1000)
    inputs = keras.Input((784,), name="pixels")
    hidden = _dense(seeds, 128, "hidden", "relu")(inputs)
    return keras.Model(inputs, _dense(seeds, 10, "logits")(hidden), name="mnist_mlp")


def mnist_cnn() -> keras.Model:
    """[B, 28, 28, 1] float32 -> two strided convs with max-pools -> Dense 32 -> 10 logits."""
    seeds = _Seeds(2000)
    inputs = keras.Input((28, 28, 1), name="image")
    h = _conv(seeds, 16, 8, stride=2, padding="same", name="conv1")(inputs)
    h = keras.layers.MaxPooling2D(2, strides=1, name="pool1")(h)
    h = _conv(seeds, 32, 4, stride=2, padding="valid", name="conv2")(h)
    h = keras.layers.MaxPooling2D(2, strides=1, name="pool2")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = _dense(seeds, 32, "hidden", "relu")(h)
    return keras.Model(inputs, _dense(seeds, 10, "logits")(h), name="mnist_cnn")


def wide_mlp() -> keras.Model:
    """[B, 3072] float32 -> Dense 512 relu -> Dense 512 relu -> Dense 10 logits (P = 1.84M)."""
    seeds = _Seeds(3000)
    inputs = keras.Input((3072,), name="pixels")
    h = _dense(seeds, 512, "hidden1", "relu")(inputs)
    h = _dense(seeds, 512, "hidden2", "relu")(h)
    return keras.Model(inputs, _dense(seeds, 10, "logits")(h), name="wide_mlp")


def transformer_block() -> keras.Model:
    """Token ids [B, 32] (vocab 1000) -> embeddings + positions -> one pre-LN block -> mean
    over tokens -> Dense 10 logits (P = 100,170)."""
    seeds = _Seeds(4000)
    tokens = keras.Input((32,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(
        1000,
        64,
        embeddings_initializer=keras.initializers.RandomNormal(0.0, 0.02, seed=4000),
        name="embedding",
    )(tokens)
    h = PositionEmbedding(seeds.glorot(), name="positions")(h)
    a = keras.layers.LayerNormalization(name="ln1")(h)
    a = keras.layers.MultiHeadAttention(4, 16, kernel_initializer=seeds.glorot(), name="attention")(
        a, a
    )
    h = keras.layers.Add(name="residual1")([h, a])
    f = keras.layers.LayerNormalization(name="ln2")(h)
    f = _dense(seeds, 128, "mlp_up", "gelu")(f)
    f = _dense(seeds, 64, "mlp_down")(f)
    h = keras.layers.Add(name="residual2")([h, f])
    h = keras.layers.GlobalAveragePooling1D(name="mean_tokens")(h)
    return keras.Model(tokens, _dense(seeds, 10, "logits")(h), name="transformer_block")


BUILTIN_MODELS: dict[str, Callable[[], keras.Model]] = {
    "mnist_mlp": mnist_mlp,
    "mnist_cnn": mnist_cnn,
    "wide_mlp": wide_mlp,
    "transformer_block": transformer_block,
}
