"""Which variables a closed-form rule covers, and which fall back to the vectorized route."""

from __future__ import annotations

from dataclasses import dataclass

import keras

from pergrad.server.engine.rules import LayerRegistry, Rule


@dataclass(frozen=True)
class Plan:
    ruled: tuple[tuple[keras.layers.Layer, Rule], ...]
    fallback: tuple[int, ...]  # positions in model.trainable_variables
    reasons: tuple[tuple[str, str], ...]  # (layer name, why it falls back)
    # For each trainable variable, in model order: "rule: <class> (<layer>)", or
    # "generic: <why>" (ModelInfo.routes).
    routes: tuple[str, ...] = ()

    def describe(self) -> str:
        ruled = ", ".join(f"{layer.name}({type(layer).__name__})" for layer, _ in self.ruled)
        fallback = ", ".join(f"{name} ({why})" for name, why in self.reasons)
        return f"closed-form rules: {ruled or 'none'}; vectorized fallback: {fallback or 'none'}"


def _own_trainable(layer: keras.layers.Layer) -> list[keras.Variable]:
    inner = {id(v) for sub in layer._flatten_layers(include_self=False) for v in sub.weights}
    return [v for v in layer.trainable_variables if id(v) not in inner]


def make_plan(model: keras.Model, registry: LayerRegistry) -> Plan:
    """A layer with a rule covers every variable it holds, its sublayers' too (a
    recurrent layer's cell); any other layer is planned by its own variables."""
    ruled, reasons, covered = [], [], set()
    routes: dict[int, str] = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        held = [v for v in layer.trainable_variables if id(v) not in covered]
        if not held:
            continue
        rule, why = registry.lookup(layer)
        if rule is not None:
            ruled.append((layer, rule))
            covered |= {id(v) for v in held}
            routes |= {id(v): f"rule: {type(layer).__name__} ({layer.name})" for v in held}
        elif {id(v) for v in held} - routes.keys() and (
            _own_trainable(layer) or registry.knows(layer)
        ):
            reasons.append((layer.name, why))
            routes |= {id(v): f"generic: {why} ({layer.name})" for v in held if id(v) not in routes}
    variables = model.trainable_variables
    fallback = tuple(i for i, v in enumerate(variables) if id(v) not in covered)
    route_of = tuple(routes.get(id(v), "generic") for v in variables)
    return Plan(tuple(ruled), fallback, tuple(reasons), route_of)
