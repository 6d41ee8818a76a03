"""A zoo of small Keras model families and their batches, every weight and array seeded.

Each builder returns a fresh model; `Family.batch(model)` a batch (x, y) for it: x one
array, a list in `model.inputs` order, or a dict by input name. tests/server/engine/
test_zoo.py checks the engine on every family against tests/oracle.py; tests/server/
test_zoo_served.py serves some of them from .keras files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tests import zoo_keras_hub as hub

L = keras.layers
ops = keras.ops

SEQUENCE = 7  # time steps of the text models
VOCABULARY = 30


def glorot(seed: int) -> keras.initializers.Initializer:
    return keras.initializers.GlorotUniform(seed=seed)


def normal(seed: int, std: float = 0.3) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(0.0, std, seed=seed)


def orthogonal(seed: int) -> keras.initializers.Initializer:
    return keras.initializers.Orthogonal(seed=seed)


def dense(units: int, seed: int, activation: str | None = None, name: str | None = None):
    """A Dense layer with a seeded kernel and a seeded non-zero bias."""
    return L.Dense(
        units,
        activation=activation,
        kernel_initializer=glorot(seed),
        bias_initializer=normal(seed + 500, 0.1),
        name=name,
    )


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def gaussian(shape: tuple[int, ...], size: int, seed: int = 0) -> np.ndarray:
    return _rng(seed).standard_normal((size, *shape)).astype(np.float32)


def tokens(size: int, seed: int = 0, length: int = SEQUENCE) -> np.ndarray:
    """Token ids in [1, VOCABULARY); 0 is kept for padding."""
    return _rng(seed).integers(1, VOCABULARY, size=(size, length)).astype(np.int32)


def classes(size: int, count: int, seed: int = 1, shape: tuple[int, ...] = ()) -> np.ndarray:
    return _rng(seed).integers(0, count, size=(size, *shape)).astype(np.int32)


def targets(size: int, width: int, seed: int = 1) -> np.ndarray:
    return (2.0 * _rng(seed).standard_normal((size, width))).astype(np.float32)


def randomize_batch_norm(model: keras.Model, seed: int) -> None:
    """Every BatchNormalization of `model` gets random moving statistics (variances far
    from one) and random gamma and beta, so a rule that ignores them is caught."""
    rng = _rng(seed)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, L.BatchNormalization):
            shape = tuple(layer.moving_mean.shape)
            layer.moving_mean.assign(rng.normal(0.0, 0.5, shape).astype(np.float32))
            layer.moving_variance.assign(rng.uniform(0.3, 2.5, shape).astype(np.float32))
            if layer.gamma is not None:
                layer.gamma.assign(rng.uniform(0.5, 1.5, shape).astype(np.float32))
            if layer.beta is not None:
                layer.beta.assign(rng.normal(0.0, 0.2, shape).astype(np.float32))


# ---- builders: () -> (model, loss) ---------------------------------------------------


def mlp():
    inputs = keras.Input((10,), name="features")
    h = dense(16, 1, "relu")(inputs)
    h = dense(12, 2, "tanh")(h)
    model = keras.Model(inputs, dense(5, 3)(h), name="mlp")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn_batch_norm():
    inputs = keras.Input((9, 9, 3), name="image")
    h = L.Conv2D(6, 3, kernel_initializer=glorot(11), bias_initializer=normal(12, 0.1))(inputs)
    h = L.BatchNormalization()(h)
    h = L.ReLU()(h)
    h = L.Conv2D(8, 3, strides=2, padding="same", kernel_initializer=glorot(13), use_bias=False)(h)
    h = L.BatchNormalization(center=False)(h)
    h = L.Activation("swish")(h)
    h = L.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, dense(4, 14)(h), name="cnn_batch_norm")
    randomize_batch_norm(model, 15)
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def depthwise_separable():
    inputs = keras.Input((8, 8, 3), name="image")
    h = L.DepthwiseConv2D(
        3,
        depth_multiplier=2,
        padding="same",
        activation="relu",
        depthwise_initializer=normal(21),
        bias_initializer=normal(22, 0.1),
    )(inputs)
    h = L.SeparableConv2D(
        5,
        3,
        strides=2,
        activation="relu",
        depthwise_initializer=normal(23),
        pointwise_initializer=normal(24),
        bias_initializer=normal(25, 0.1),
    )(h)
    h = L.Flatten()(h)
    model = keras.Model(inputs, dense(4, 26)(h), name="depthwise_separable")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mobilenet_v3_small():
    keras.utils.set_random_seed(31)
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=10, include_top=True
    )
    randomize_batch_norm(model, 32)
    return model, keras.losses.SparseCategoricalCrossentropy()


def resnet50():
    keras.utils.set_random_seed(41)
    model = keras.applications.ResNet50(
        input_shape=(32, 32, 3), weights=None, classes=10, include_top=True
    )
    randomize_batch_norm(model, 42)
    return model, keras.losses.SparseCategoricalCrossentropy()


class AddPositions(L.Layer):
    """A learned position table added to the tokens' embeddings: no rule knows it."""

    def build(self, input_shape) -> None:
        self.table = self.add_weight(
            shape=tuple(input_shape[1:]), initializer=normal(51, 0.2), name="table"
        )

    def call(self, inputs):
        return inputs + self.table


def transformer_encoder():
    """Two inputs, token ids and a 0/1 padding mask; attention ignores padded keys."""
    ids = keras.Input((SEQUENCE,), dtype="int32", name="ids")
    mask = keras.Input((SEQUENCE,), dtype="float32", name="mask")
    h = L.Embedding(VOCABULARY, 8, embeddings_initializer=normal(52))(ids)
    h = AddPositions()(h)
    keys = ops.cast(mask, "bool")
    attention_mask = ops.logical_and(keys[:, None, :], ops.ones_like(keys)[:, :, None])
    attended = L.MultiHeadAttention(
        num_heads=2,
        key_dim=4,
        kernel_initializer=glorot(53),
        bias_initializer=normal(54, 0.1),
    )(h, h, attention_mask=attention_mask)
    h = L.LayerNormalization(gamma_initializer=normal(55), beta_initializer=normal(56))(
        h + attended
    )
    ffn = dense(8, 58)(dense(16, 57, "gelu")(h))
    h = L.LayerNormalization()(h + ffn)
    pooled = ops.sum(h * mask[:, :, None], axis=1) / ops.sum(mask, axis=1, keepdims=True)
    model = keras.Model([ids, mask], dense(3, 59)(pooled), name="transformer_encoder")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dict_features():
    """A dict of inputs: numeric features and a categorical id."""
    inputs = {
        "numeric": keras.Input((5,), name="numeric"),
        "category": keras.Input((1,), dtype="int32", name="category"),
    }
    embedded = L.Flatten()(L.Embedding(6, 3, embeddings_initializer=normal(61))(inputs["category"]))
    h = L.Concatenate()([inputs["numeric"], embedded])
    h = dense(8, 62, "relu")(h)
    model = keras.Model(inputs, dense(3, 63)(h), name="dict_features")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def computed_ids():
    """Ids a layer computes (float features cast to int), then an embedding: no input
    feeds the embedding, so only the engine's probe (`engine.ids`) checks its ids."""
    features = keras.Input((3,), name="features")
    ids = L.Lambda(lambda t: keras.ops.cast(t, "int32"), name="to_ids")(features)
    embedded = L.Flatten()(L.Embedding(VOCABULARY, 4, embeddings_initializer=normal(91))(ids))
    model = keras.Model(features, dense(3, 92)(embedded), name="computed_ids")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dict_attention():
    """A dict of inputs, token ids and a 0/1 padding mask: attention over the unpadded
    keys only, then the mean over the unpadded steps. No residual path: padded steps
    reach the loss through nothing, so the embedding of padding (id 0) gets no gradient."""
    inputs = {
        "ids": keras.Input((SEQUENCE,), dtype="int32", name="ids"),
        "mask": keras.Input((SEQUENCE,), dtype="float32", name="mask"),
    }
    mask = inputs["mask"]
    h = L.Embedding(VOCABULARY, 6, embeddings_initializer=normal(65, 1.0))(inputs["ids"])
    keys = ops.cast(mask, "bool")
    attended = L.MultiHeadAttention(
        num_heads=2,
        key_dim=3,
        kernel_initializer=glorot(66),
        bias_initializer=normal(67, 0.1),
    )(h, h, attention_mask=ops.logical_and(keys[:, None, :], ops.ones_like(keys)[:, :, None]))
    h = dense(6, 68, "tanh")(attended)
    pooled = ops.sum(h * mask[:, :, None], axis=1) / ops.sum(mask, axis=1, keepdims=True)
    model = keras.Model(inputs, dense(3, 69)(pooled), name="dict_attention")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _text(body: Callable[[Any], Any], name: str, seed: int):
    ids = keras.Input((SEQUENCE,), dtype="int32", name="ids")
    h = L.Embedding(VOCABULARY, 6, embeddings_initializer=normal(seed))(ids)
    model = keras.Model(ids, dense(3, seed + 9)(body(h)), name=name)
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _recurrent(kind: type, units: int, seed: int, **kwargs: Any) -> L.Layer:
    return kind(
        units,
        kernel_initializer=glorot(seed),
        recurrent_initializer=orthogonal(seed + 1),
        bias_initializer=normal(seed + 2, 0.1),
        **kwargs,
    )


def lstm_text():
    return _text(lambda h: _recurrent(L.LSTM, 5, 71)(h), "lstm_text", 70)


def gru_pooled():
    """return_sequences=True, then pooling over time."""

    def body(h):
        h = _recurrent(L.GRU, 5, 81, return_sequences=True)(h)
        return L.GlobalAveragePooling1D()(h)

    return _text(body, "gru_pooled", 80)


def gru_reset_before():
    """A GRU with reset_after=False (the Keras 2 / TF1 form), last state only."""
    return _text(lambda h: _recurrent(L.GRU, 5, 201, reset_after=False)(h), "gru_reset_before", 200)


def bilstm_text():
    """A bidirectional LSTM, its two last states concatenated."""
    return _text(lambda h: L.Bidirectional(_recurrent(L.LSTM, 4, 86))(h), "bilstm_text", 85)


def bilstm_stacked():
    """Bidirectional LSTM over the sequence, a second LSTM stacked on it."""

    def body(h):
        h = L.Bidirectional(_recurrent(L.LSTM, 4, 91, return_sequences=True))(h)
        return _recurrent(L.LSTM, 4, 94)(h)

    return _text(body, "bilstm_stacked", 90)


def stacked_lstm_any_length():
    """Two stacked LSTMs over token sequences of any length (the time axis is None)."""
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = L.Embedding(VOCABULARY, 6, embeddings_initializer=normal(95))(ids)
    h = _recurrent(L.LSTM, 4, 96, return_sequences=True)(h)
    h = _recurrent(L.LSTM, 4, 99)(h)
    model = keras.Model(ids, dense(3, 98)(h), name="stacked_lstm_any_length")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def masked_lstm():
    """Padding (id 0) masked by the Embedding; the LSTM's last state skips padded steps."""
    ids = keras.Input((SEQUENCE,), dtype="int32", name="ids")
    h = L.Embedding(VOCABULARY, 6, mask_zero=True, embeddings_initializer=normal(177))(ids)
    h = _recurrent(L.LSTM, 5, 176)(h)
    model = keras.Model(ids, dense(3, 179)(h), name="masked_lstm")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def two_tower():
    """One Dense applied to both inputs (shared weights), then a head on both towers."""
    left = keras.Input((6,), name="left")
    right = keras.Input((6,), name="right")
    shared = dense(5, 101, "tanh", name="shared")
    both = L.Concatenate()([shared(left), shared(right), shared(left) * shared(right)])
    model = keras.Model([left, right], dense(2, 102)(both), name="two_tower")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def multi_label():
    inputs = keras.Input((8,), name="features")
    h = dense(10, 111, "relu")(inputs)
    model = keras.Model(inputs, dense(4, 112, "sigmoid")(h), name="multi_label")
    return model, keras.losses.BinaryCrossentropy()


def regression():
    inputs = keras.Input((6,), name="features")
    h = dense(12, 121, "relu")(inputs)
    h = dense(8, 122, "tanh")(h)
    model = keras.Model(inputs, dense(2, 123)(h), name="regression")
    return model, keras.losses.MeanSquaredError()


def huber_regression():
    inputs = keras.Input((6,), name="features")
    h = dense(8, 131, "elu")(inputs)
    model = keras.Model(inputs, dense(3, 132)(h), name="huber_regression")
    return model, keras.losses.Huber(delta=0.7)


def log_cosh_per_value(y_true, y_pred):
    """A custom loss returning one value per output element ([B, C]), not per example."""
    error = y_pred - y_true
    return tf.math.log(tf.math.cosh(error)) + 0.1 * tf.abs(error)


def custom_loss():
    inputs = keras.Input((5,), name="features")
    h = dense(7, 141, "sigmoid")(inputs)
    model = keras.Model(inputs, dense(3, 142)(h), name="custom_loss")
    model.compile(loss=log_cosh_per_value)  # the engine takes the compiled loss
    return model, log_cosh_per_value


def conv1d_sequence():
    inputs = keras.Input((12, 3), name="signal")
    h = L.Conv1D(4, 3, padding="causal", dilation_rate=2, kernel_initializer=glorot(151))(inputs)
    h = L.Conv1D(
        6, 3, strides=2, activation="relu", kernel_initializer=glorot(152), bias_initializer="ones"
    )(h)
    h = L.GlobalMaxPooling1D()(h)
    model = keras.Model(inputs, dense(3, 153)(h), name="conv1d_sequence")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def sequence_tagger():
    """Output [B, T, C] with sparse labels [B, T]: the loss is the mean over time steps."""
    ids = keras.Input((SEQUENCE,), dtype="int32", name="ids")
    h = L.Embedding(VOCABULARY, 6, embeddings_initializer=normal(161))(ids)
    h = L.Conv1D(6, 3, padding="same", activation="relu", kernel_initializer=glorot(162))(h)
    model = keras.Model(ids, dense(4, 163)(h), name="sequence_tagger")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def masked_tagger():
    """Padding (id 0) masked by the Embedding; an LSTM tags every step. Keras' loss
    of an example averages over its unmasked steps only (Loss.__call__ reads the mask
    the output carries)."""
    ids = keras.Input((SEQUENCE,), dtype="int32", name="ids")
    h = L.Embedding(VOCABULARY, 6, mask_zero=True, embeddings_initializer=normal(171))(ids)
    h = _recurrent(L.LSTM, 5, 172, return_sequences=True)(h)
    model = keras.Model(ids, dense(3, 175)(h), name="masked_tagger")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ---- batches: (model, size) -> (x, y) ------------------------------------------------


def _padded_tokens(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids with trailing padding (at least two real tokens each) and the 0/1 mask."""
    ids = tokens(size, seed)
    lengths = _rng(seed + 1).integers(2, SEQUENCE + 1, size=size)
    lengths[0] = SEQUENCE - 3  # the first example is always padded
    mask = (np.arange(SEQUENCE)[None, :] < lengths[:, None]).astype(np.float32)
    return np.where(mask > 0, ids, 0).astype(np.int32), mask


def _class_batch(shape: tuple[int, ...], count: int):
    return lambda model, size: (gaussian(shape, size), classes(size, count))


def _text_batch(model, size):
    return tokens(size), classes(size, 3)


def _padded_text_batch(model, size):
    return _padded_tokens(size, 11)[0], classes(size, 3)


def _transformer_batch(model, size):
    ids, mask = _padded_tokens(size, 5)
    return [ids, mask], classes(size, 3)


def _dict_attention_batch(model, size):
    ids, mask = _padded_tokens(size, 13)
    return {"ids": ids, "mask": mask}, classes(size, 3, seed=14)


def _computed_ids_batch(model, size):
    return tokens(size, 17, length=3).astype(np.float32), classes(size, 3)


def _dict_batch(model, size):
    x = {
        "numeric": gaussian((5,), size),
        "category": classes(size, 6, seed=7, shape=(1,)),
    }
    return x, classes(size, 3)


def _two_tower_batch(model, size):
    return [gaussian((6,), size, 0), gaussian((6,), size, 3)], classes(size, 2)


def _multi_label_batch(model, size):
    return gaussian((8,), size), _rng(2).integers(0, 2, size=(size, 4)).astype(np.float32)


def _regression_batch(width: int, features: int):
    return lambda model, size: (gaussian((features,), size), targets(size, width))


def _tagger_batch(count: int, padded: bool):
    def batch(model, size):
        ids = _padded_tokens(size, 9)[0] if padded else tokens(size, 9)
        return ids, classes(size, count, shape=(SEQUENCE,))

    return batch


@dataclass(frozen=True)
class Family:
    """A model family: its builder, its batch, whether every variable takes a closed-form
    rule (`ruled`; False: some take the generic route; the zoo test holds both), the
    engine's XLA setting, whether the model is small enough for full per-example
    gradients (else norms and a clipped sum only), and the batch size."""

    build: Callable[[], tuple[keras.Model, Any]]
    batch: Callable[[keras.Model, int], tuple[Any, np.ndarray]]
    ruled: bool
    jit_compile: Any = False
    full: bool = True
    size: int = 3


FAMILIES: dict[str, Family] = {
    "mlp": Family(mlp, _class_batch((10,), 5), ruled=True, jit_compile="auto"),
    "cnn_batch_norm": Family(cnn_batch_norm, _class_batch((9, 9, 3), 4), ruled=True, size=4),
    "depthwise_separable": Family(depthwise_separable, _class_batch((8, 8, 3), 4), ruled=True),
    # The keras.applications families: two examples (one clipped, one not), the fewest
    # that tell examples apart, since their float64 oracle costs seconds an example.
    "mobilenet_v3_small": Family(
        mobilenet_v3_small, _class_batch((32, 32, 3), 10), ruled=True, full=False, size=2
    ),
    "resnet50": Family(resnet50, _class_batch((32, 32, 3), 10), ruled=True, full=False, size=2),
    # AddPositions (a custom layer) has no rule; everything else is ruled.
    "transformer_encoder": Family(
        transformer_encoder, _transformer_batch, ruled=False, jit_compile="auto"
    ),
    "dict_features": Family(dict_features, _dict_batch, ruled=True, size=5),
    "computed_ids": Family(computed_ids, _computed_ids_batch, ruled=True, jit_compile=True),
    "dict_attention": Family(dict_attention, _dict_attention_batch, ruled=True, size=4),
    "lstm_text": Family(lstm_text, _text_batch, ruled=True, jit_compile="auto"),
    "gru_pooled": Family(gru_pooled, _text_batch, ruled=True),
    # The GRU rule needs reset_after=True: this GRU takes the generic route. (That "auto"
    # then runs such a route without XLA, which cannot compile it, is test_rules'.)
    # Two examples: the size the engine traces at start-up, so "none" reuses that trace
    # (the vectorized families of three examples hold the padding to a bucket of four).
    "gru_reset_before": Family(gru_reset_before, _text_batch, ruled=False, size=2),
    "bilstm_text": Family(bilstm_text, _text_batch, ruled=True),
    "bilstm_stacked": Family(bilstm_stacked, _text_batch, ruled=True),
    # A recurrent rule needs a time axis of fixed length: both LSTMs take the generic route.
    "stacked_lstm_any_length": Family(stacked_lstm_any_length, _text_batch, ruled=False),
    "masked_lstm": Family(masked_lstm, _padded_text_batch, ruled=True),
    "two_tower": Family(two_tower, _two_tower_batch, ruled=True),
    "multi_label": Family(multi_label, _multi_label_batch, ruled=True, size=4),
    "regression": Family(regression, _regression_batch(2, 6), ruled=True),
    "huber_regression": Family(huber_regression, _regression_batch(3, 6), ruled=True),
    "custom_loss": Family(custom_loss, _regression_batch(3, 5), ruled=True),
    "conv1d_sequence": Family(conv1d_sequence, _class_batch((12, 3), 3), ruled=True),
    "sequence_tagger": Family(sequence_tagger, _tagger_batch(4, padded=False), ruled=True),
    "masked_tagger": Family(masked_tagger, _tagger_batch(3, padded=True), ruled=True),
}

# keras-hub backbones (tests/zoo_keras_hub.py): every layer they are made of takes a rule,
# LoRA factors included; the causal LMs use their token table in reverse too (GPT-2's
# tied: one variable, two uses; Llama's untied).
FAMILIES |= {
    **{
        f"{name}_classifier": Family(hub.classifier(name, seed), hub.batch, ruled=True)
        for seed, name in enumerate(hub.BACKBONES, start=300)
    },
    **{
        f"{name}_lora": Family(hub.classifier(name, seed, lora=True), hub.batch, ruled=True)
        for seed, name in ((310, "gpt2"), (311, "gemma"), (312, "llama"))
    },
    # mean-pooled, under XLA: three examples run in a pass of four, whose padding example
    # must not make the clipped sum NaN (the mean over its mask would be 0 / 0)
    "bert_mean_pooled_lora": Family(
        hub.classifier("bert", 322, lora=True, mean=True), hub.batch, ruled=True, jit_compile=True
    ),
    "gpt2_causal_lm": Family(hub.causal_lm("gpt2", 320), hub.lm_batch, ruled=True),
    # keras-hub's own tasks, built on the backbone's inputs: token ids [B, any]
    "gpt2_causal_lm_task": Family(hub.task("GPT2CausalLM", "gpt2", 323), hub.lm_batch, ruled=True),
    "bert_text_classifier_task": Family(
        hub.task("BertTextClassifier", "bert", 324), hub.batch, ruled=True
    ),
    "llama_causal_lm": Family(
        hub.causal_lm("llama", 321), hub.lm_batch, ruled=True, jit_compile=True
    ),
}
