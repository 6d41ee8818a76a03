"""Closed-form per-example gradient rules, one module per layer family.

A rule turns what one ordinary forward and backward pass already has, the layer's input
`inputs` and the gradient `output_grad` of the summed loss with respect to the layer's
output before its activation, into each example's gradient for each of the layer's
variables. With the batch first everywhere:

    rule(layer, inputs, output_grad) -> {variable.path: Grad}

`Grad` is a dense [B, *variable.shape] tensor or a factored form (`pergrad.server.engine.
grads`). `applies(layer)` returns None when the rule covers this layer's configuration,
else the reason it does not (the layer's variables then use the generic vectorized route).
Adding a layer type is adding one module here, with its `RULE` and the `LAYERS` it covers:
classes, or the import paths of classes from packages the server does not depend on
(keras-hub's), matched when a model that uses them is loaded.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad

RuleFn = Callable[[Any, tf.Tensor, tf.Tensor], dict[str, Grad]]


def always(layer: keras.layers.Layer) -> str | None:
    return None


@dataclass(frozen=True)
class Rule:
    per_example: RuleFn
    applies: Callable[[keras.layers.Layer], str | None] = always
    # For layers whose per-example gradients need more than (inputs, dL/dz): computes the
    # layer's output itself, recording what `per_example` then gets (see `capture`).
    forward: Callable[..., tuple[Any, Any, Any]] | None = None


LayerKey = type | str  # a class, or its import path: "module.Class"


def import_path(layer_class: type) -> str:
    return f"{layer_class.__module__}.{layer_class.__qualname__}"


class LayerRegistry:
    """Layer class -> rule; exact classes only, since a subclass may change the math."""

    def __init__(self) -> None:
        self._rules: dict[LayerKey, Rule] = {}
        self._probes: list[Rule] = []

    def register(self, layer_class: LayerKey, rule: Rule) -> None:
        self._rules[layer_class] = rule

    def register_probe(self, rule: Rule) -> None:
        """Offer `rule` every layer of a class no rule names: its `applies` decides, by
        what the layer computes."""
        self._probes.append(rule)

    def without(self, layer_classes: tuple[LayerKey, ...]) -> LayerRegistry:
        """A copy leaving these classes to the generic route (to measure a rule's gain)."""
        copy = LayerRegistry()
        copy._rules = {k: r for k, r in self._rules.items() if k not in layer_classes}
        copy._probes = list(self._probes)
        return copy

    def _rule(self, layer: keras.layers.Layer) -> Rule | None:
        kind = type(layer)
        return self._rules.get(kind) or self._rules.get(import_path(kind))

    def knows(self, layer: keras.layers.Layer) -> bool:
        """Whether a rule exists for this layer's class (whether or not it applies)."""
        return self._rule(layer) is not None

    def lookup(self, layer: keras.layers.Layer) -> tuple[Rule | None, str]:
        """(rule, "") when one covers `layer`, else (None, the reason)."""
        rule = self._rule(layer)
        if rule is None:
            return self._probed(layer)
        reason = rule.applies(layer)
        return (None, reason) if reason else (rule, "")

    def _probed(self, layer: keras.layers.Layer) -> tuple[Rule | None, str]:
        why = None
        for rule in self._probes:
            why = rule.applies(layer)
            if not why:
                return rule, ""
        # a probe's own reason says more
        return None, why or f"no rule for {type(layer).__name__}"

    def names(self) -> list[str]:
        """The class names of the layers with a rule (a probe's layers are not named)."""
        return sorted(
            k.rsplit(".", 1)[-1] if isinstance(k, str) else k.__name__ for k in self._rules
        )


def default_registry() -> LayerRegistry:
    """Every rule module of this package: its RULE for each class in its LAYERS (a module
    with no RULE holds algebra that rules share)."""
    registry = LayerRegistry()
    for module in pkgutil.iter_modules(__path__):
        rule_module = importlib.import_module(f"{__name__}.{module.name}")
        if not hasattr(rule_module, "RULE"):
            continue
        for layer_class in rule_module.LAYERS:
            registry.register(layer_class, rule_module.RULE)
        if getattr(rule_module, "FOUND_BY_PROBE", False):
            registry.register_probe(rule_module.RULE)
    return registry
