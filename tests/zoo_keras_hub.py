"""keras-hub transformer backbones as fine-tuners build them, at tiny random-init configs
(nothing downloaded): each with a classifier head on its first token, or as a causal
language model through its own token embedding in reverse (tied or untied), with and
without LoRA (`backbone.enable_lora`: only the LoRA factors and the head train). Every
builder seeds Keras first, so its weights are the same on every call.

`tests/zoo.py` makes them families of the zoo; this module needs only keras and keras-hub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np

VOCABULARY = 50
STEPS = 7
CLASSES = 3
LORA_RANK = 2
_SMALL = {"vocabulary_size": VOCABULARY, "num_layers": 1, "hidden_dim": 8, "intermediate_dim": 16}
_ENCODER = {**_SMALL, "num_heads": 2, "max_sequence_length": STEPS}
_DECODER = {**_SMALL, "num_query_heads": 2, "num_key_value_heads": 1}

BACKBONES: dict[str, Callable[[], keras.Model]] = {
    "gpt2": lambda: keras_hub.models.GPT2Backbone(**_ENCODER),
    "bert": lambda: keras_hub.models.BertBackbone(**_ENCODER),
    "distil_bert": lambda: keras_hub.models.DistilBertBackbone(**_ENCODER),
    "roberta": lambda: keras_hub.models.RobertaBackbone(**_ENCODER),
    "gemma": lambda: keras_hub.models.GemmaBackbone(**_DECODER, head_dim=4),
    "llama": lambda: keras_hub.models.LlamaBackbone(**_DECODER),
    "mistral": lambda: keras_hub.models.MistralBackbone(**_DECODER),
}


def _backbone(name: str, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    backbone = BACKBONES[name]()
    rng = np.random.default_rng(seed)
    for variable in backbone.trainable_variables:  # zeros and ones tell no rule apart
        noise = rng.normal(0.0, 0.2, variable.shape).astype(np.float32)
        variable.assign(variable.numpy() + noise)
    return backbone


def _inputs(backbone: keras.Model) -> dict[str, Any]:
    return {i.name: keras.Input((STEPS,), dtype=i.dtype, name=i.name) for i in backbone.inputs}


def _hidden(backbone: keras.Model, inputs: dict[str, Any]) -> Any:
    hidden = backbone(inputs)
    return hidden["sequence_output"] if isinstance(hidden, dict) else hidden


def classifier(
    name: str, seed: int, lora: bool = False, mean: bool = False
) -> Callable[[], tuple[keras.Model, Any]]:
    """A classifier on the backbone's first token (a nested functional model), or on the
    mean of its outputs over the unpadded tokens (`mean`)."""

    def build() -> tuple[keras.Model, Any]:
        backbone = _backbone(name, seed)
        if lora:
            backbone.enable_lora(LORA_RANK)
            _perturb_lora(backbone, seed)
        inputs = _inputs(backbone)
        head = keras.layers.Dense(
            CLASSES, kernel_initializer=keras.initializers.GlorotUniform(seed), name="head"
        )
        hidden = _hidden(backbone, inputs)
        pooled = _masked_mean(hidden, inputs["padding_mask"]) if mean else hidden[:, 0]
        model = keras.Model(inputs, head(pooled), name=f"{name}_classifier")
        return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    return build


def _masked_mean(hidden: Any, padding_mask: Any) -> Any:
    """The mean over the unpadded steps: 0 / 0 for an example of padding alone."""
    mask = keras.ops.expand_dims(keras.ops.cast(padding_mask, hidden.dtype), -1)
    return keras.ops.sum(hidden * mask, axis=1) / keras.ops.sum(mask, axis=1)


def causal_lm(name: str, seed: int) -> Callable[[], tuple[keras.Model, Any]]:
    """Next-token logits through the backbone's token embedding in reverse (GPT2CausalLM's
    shape; GPT-2's table is tied, Llama's is not)."""

    def build() -> tuple[keras.Model, Any]:
        backbone = _backbone(name, seed)
        inputs = _inputs(backbone)
        logits = backbone.token_embedding(_hidden(backbone, inputs), reverse=True)
        model = keras.Model(inputs, logits, name=f"{name}_causal_lm")
        return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    return build


def task(kind: str, name: str, seed: int) -> Callable[[], tuple[keras.Model, Any]]:
    """keras-hub's own task on the backbone (no preprocessor), as a user builds and
    compiles it: built on `backbone.input`, so its time axis has no fixed length."""

    def build() -> tuple[keras.Model, Any]:
        backbone = _backbone(name, seed)
        options = {"num_classes": CLASSES} if kind.endswith("Classifier") else {}
        model = getattr(keras_hub.models, kind)(backbone=backbone, preprocessor=None, **options)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(loss=loss)
        return model, loss

    return build


def _perturb_lora(backbone: keras.Model, seed: int) -> None:
    """LoRA's B starts at zero, where A's gradient is zero too: random factors test both."""
    rng = np.random.default_rng(seed + 1)
    for variable in backbone.trainable_variables:
        if "lora_kernel" in variable.path:
            variable.assign(rng.normal(0.0, 0.3, variable.shape).astype(np.float32))


def batch(model: keras.Model, size: int, labels: tuple[int, ...] = ()) -> tuple[dict, np.ndarray]:
    """Token ids (the first example's last two steps padded), a padding mask, segment ids
    where the backbone takes them, and class labels (or next-token labels [B, T])."""
    rng = np.random.default_rng(size)
    ids = rng.integers(1, VOCABULARY, size=(size, STEPS)).astype(np.int32)
    mask = np.ones((size, STEPS), np.int32)
    mask[0, -2:] = 0
    values = {"token_ids": np.where(mask > 0, ids, 0), "padding_mask": mask}
    values["segment_ids"] = (np.arange(STEPS)[None] >= STEPS // 2).repeat(size, 0).astype(np.int32)
    x = {i.name: values[i.name] for i in model.inputs}
    if labels:
        return x, rng.integers(0, VOCABULARY, size=(size, STEPS)).astype(np.int32)
    return x, rng.integers(0, CLASSES, size=size).astype(np.int32)


def lm_batch(model: keras.Model, size: int) -> tuple[dict, np.ndarray]:
    return batch(model, size, labels=(STEPS,))
