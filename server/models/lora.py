"""LoRA enabled on a served model at load (`--lora`, `pergrad.server.lora_spec`).

Keras merges LoRA into the kernels when a model is saved, so a `.keras` file fine-tuned
with LoRA comes back as a model whose every weight trains. The server enables LoRA
itself: on the target layers (Keras' `enable_lora`, A drawn from an initializer seeded by
the layer's place in the targets, so replicas start equal; B zero), then freezes every
variable except the LoRA factors and those of the layers named to train.
"""

from __future__ import annotations

import logging
import math

import keras

from pergrad.server.lora_spec import LoraSpec
from pergrad.server.models.keras_file import ModelLoadError

_LOGGER = logging.getLogger(__name__)
# Layer names a refusal quotes, at most.
_QUOTED = 12


def _layers(model: keras.Model) -> list[keras.layers.Layer]:
    return list(model._flatten_layers(include_self=False, recursive=True))


def backbones(model: keras.Model) -> list[keras.layers.Layer]:
    """keras-hub backbones inside `model` (or `model` itself): they name their LoRA layers."""
    candidates = [model, *_layers(model)]
    return [layer for layer in candidates if hasattr(layer, "default_lora_layer_names")]


def _targets(model: keras.Model, spec: LoraSpec) -> list[keras.layers.Layer]:
    """The layers named to take LoRA; by default those each keras-hub backbone names
    (keras-hub's own list spans its families: a backbone holds some of them)."""
    able = [
        layer
        for layer in _layers(model)
        if hasattr(layer, "enable_lora") and not isinstance(layer, keras.Model)
    ]
    choices = sorted({layer.name for layer in able})[:_QUOTED]
    if spec.targets:
        targets = [layer for layer in able if layer.name in spec.targets]
        missing = set(spec.targets) - {layer.name for layer in targets}
        if missing:
            raise ModelLoadError(
                f"--lora: model {model.name!r} has no layer that takes LoRA named "
                f"{sorted(missing)}; its Dense, EinsumDense, Embedding and Conv layers "
                f"include {choices}"
            )
        return targets
    found = backbones(model)
    names = {name for backbone in found for name in backbone.default_lora_layer_names()}
    targets = [layer for layer in able if layer.name in names]
    if not targets:
        held = "holds no keras-hub backbone" if not found else "has none of its backbone's layers"
        raise ModelLoadError(
            f"--lora: model {model.name!r} {held} to take LoRA by default; name the layers: "
            f"--lora rank=R,targets=layer1+layer2 (its layers that take LoRA include {choices})"
        )
    return targets


def _trained(model: keras.Model, spec: LoraSpec) -> set[int]:
    """ids of the variables that train besides the LoRA factors."""
    if spec.train is not None:
        named = [layer for layer in _layers(model) if layer.name in spec.train]
        missing = set(spec.train) - {layer.name for layer in named}
        if missing:
            raise ModelLoadError(
                f"--lora: model {model.name!r} has no layer named {sorted(missing)}"
            )
        return {id(v) for layer in named for v in layer.weights}
    inside = {id(v) for backbone in backbones(model) for v in backbone.weights}
    return {id(v) for v in model.weights if id(v) not in inside}


def enable_lora(model: keras.Model, spec: LoraSpec) -> str:
    """Enable LoRA on `model` as `spec` says; returns what was done, as ModelInfo says it."""
    targets = _targets(model, spec)
    trained = _trained(model, spec)
    for seed, layer in enumerate(targets):
        if getattr(layer, "lora_enabled", False):
            raise ModelLoadError(f"--lora: layer {layer.name!r} has LoRA enabled already")
        layer.trainable = True
        layer.enable_lora(
            spec.rank, lora_alpha=spec.alpha, a_initializer=keras.initializers.HeUniform(seed)
        )
    factors = {id(layer.lora_kernel_a) for layer in targets} | {
        id(layer.lora_kernel_b) for layer in targets
    }
    for variable in model.weights:
        if variable.trainable:
            variable.trainable = id(variable) in factors or id(variable) in trained
    alpha = spec.alpha if spec.alpha is not None else spec.rank
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    text = (
        f"LoRA rank {spec.rank}, alpha {alpha:g} on {len(targets)} layers "
        f"({', '.join(sorted({layer.name for layer in targets}))}); "
        f"{len(model.trainable_variables)} variables train, {parameters} parameters"
    )
    _LOGGER.info("model %s: %s", model.name, text)
    return text


def warn_if_lora_lost(model: keras.Model) -> None:
    """A keras-hub model served without --lora trains every weight: say so, since a model
    fine-tuned with LoRA and saved comes back that way."""
    if backbones(model):
        parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
        _LOGGER.warning(
            "model %s holds a keras-hub backbone and all its %d parameters train: a model "
            "saved with LoRA loses it (Keras merges the factors into the kernels); serve it "
            "with --lora rank=R to train LoRA factors only",
            model.name,
            parameters,
        )
