"""CLIPPED_SUM: one DP-SGD step's gradient: sum_b min(1, C / ||g_b||) g_b (+ noise).

Norms come from the factored gradients; the clipped sum is then one weighted product
per variable ((c a)^T g for Dense), so no second backward pass and no B x P tensor.
Gaussian noise of std noise_multiplier * max_norm is added from `seed` per variable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions import Selected, generator
from pergrad.server.engine.reductions.factored import weighted_sum
from pergrad.server.engine.reductions.norms import squared
from pergrad.server.errors import InvalidArgument

NOISE_STREAM = 2


class ClippedSum:
    def __init__(
        self,
        variables: Sequence[Selected],
        *,
        max_norm: float | None = None,
        noise_multiplier: float = 0.0,
        seed: int = 0,
    ) -> None:
        if max_norm is None or not max_norm > 0:
            raise InvalidArgument(f"max_norm: clipped_sum needs a positive bound, got {max_norm}")
        if not noise_multiplier >= 0:
            raise InvalidArgument(f"noise_multiplier: must be >= 0, got {noise_multiplier}")
        self._variables = variables
        self._max_norm = float(max_norm)
        self._noise = float(noise_multiplier)
        self._seed = int(seed)
        self._sums = {v.name: np.zeros(v.shape, np.float32) for v in variables}
        self._norms: list[np.ndarray] = []

    def add(self, grads: Mapping[str, Grad]) -> None:
        norms = np.sqrt(sum(squared(self._variables, grads).values()))
        scale = np.minimum(1.0, self._max_norm / np.maximum(norms, 1e-30))
        for v in self._variables:
            self._sums[v.name] += weighted_sum(grads[v.name], scale, v.shape)
        self._norms.append(norms)

    def finish(self) -> dict[str, Any]:
        norms = np.concatenate(self._norms)
        if self._noise:
            std = self._noise * self._max_norm
            for v in self._variables:
                noise = generator(self._seed, v.index, NOISE_STREAM).standard_normal(v.shape)
                self._sums[v.name] += (std * noise).astype(np.float32)
        return {
            "clipped_sum": self._sums,
            "norms": norms.astype(np.float32),
            "num_clipped": int((norms > self._max_norm).sum()),
        }
