"""Closed-form per-example gradient rules, one module per layer family.

A rule turns what one ordinary forward and backward pass already has, the layer's input
`inputs` and the gradient `output_grad` of the summed loss with respect to the layer's
output before its activation, into each example's gradient for each of the layer's
variables. With the batch first everywhere:

    rule(layer, inputs, output_grad) -> {variable.path: Grad}

`Grad` is a dense [B, *variable.shape] tensor or a factored form (`pergrad.server.engine.
grads`). `applies(layer)` returns None when the rule covers this layer's configuration,
else the reason it does not (the layer's variables then use the generic vectorized route).
Adding a layer type is adding one module here, with its `RULE` and the `LAYERS` it covers.
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


class LayerRegistry:
    """Layer class -> rule; exact classes only, since a subclass may change the math."""

    def __init__(self) -> None:
        self._rules: dict[type, Rule] = {}

    def register(self, layer_class: type, rule: Rule) -> None:
        self._rules[layer_class] = rule

    def without(self, layer_classes: tuple[type, ...]) -> LayerRegistry:
        """A copy leaving these classes to the generic route (to measure a rule's gain)."""
        copy = LayerRegistry()
        copy._rules = {k: r for k, r in self._rules.items() if k not in layer_classes}
        return copy

    def knows(self, layer: keras.layers.Layer) -> bool:
        """Whether a rule exists for this layer's class (whether or not it applies)."""
        return type(layer) in self._rules

    def lookup(self, layer: keras.layers.Layer) -> tuple[Rule | None, str]:
        """(rule, "") when one covers `layer`, else (None, the reason)."""
        rule = self._rules.get(type(layer))
        if rule is None:
            return None, f"no rule for {type(layer).__name__}"
        reason = rule.applies(layer)
        return (None, reason) if reason else (rule, "")


def default_registry() -> LayerRegistry:
    """Every rule module of this package: its RULE for each class in its LAYERS."""
    registry = LayerRegistry()
    for module in pkgutil.iter_modules(__path__):
        rule_module = importlib.import_module(f"{__name__}.{module.name}")
        for layer_class in rule_module.LAYERS:
            registry.register(layer_class, rule_module.RULE)
    return registry
