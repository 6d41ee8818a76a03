"""MOMENTS: sum_b g_b and sum_b g_b^2 per parameter (diagonal empirical Fisher, variance,
gradient noise scale). For flat Dense inputs both are single products of the factors:
sum = a^T g, sum of squares = (a^2)^T (g^2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions.factored import examples, sum_of_squares, weighted_sum
from pergrad.server.engine.slices import VariableSpec


class Moments:
    def __init__(self, variables: Sequence[VariableSpec]) -> None:
        self._variables = variables
        self._sum = {v.name: np.zeros(v.shape, np.float32) for v in variables}
        self._squares = {v.name: np.zeros(v.shape, np.float32) for v in variables}

    def add(self, grads: Mapping[str, Grad]) -> None:
        for v in self._variables:
            grad = grads[v.name]
            self._sum[v.name] += weighted_sum(grad, np.ones(examples(grad), np.float32), v.shape)
            self._squares[v.name] += sum_of_squares(grad, v.shape, v.dtype)

    def finish(self) -> dict[str, Any]:
        return {"sum": self._sum, "sum_squares": self._squares}


REDUCTION = Moments
