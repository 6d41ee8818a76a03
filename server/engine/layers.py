"""Keras layers pergrad itself defines for its built-in models; their rules are in `rules/`.

They live in the engine so that a rule can name its layer class without importing the
models, which import the engine.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="pergrad")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a [B, T, D] sequence."""

    def __init__(
        self, initializer: keras.initializers.Initializer | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer or "glorot_uniform")

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer=self.initializer, name="positions"
        )

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        return inputs + self.positions[None]

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "initializer": keras.initializers.serialize(self.initializer),
        }
