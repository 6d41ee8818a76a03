"""CLIPPED_SUM: one DP-SGD step's gradient: sum_b min(1, C / ||g_b||) g_b (+ noise).

Norms come from the factored gradients; the clipped sum is then one weighted product
per variable ((c a)^T g for Dense), so no second backward pass and no B x P tensor.
Both run inside the pass (`in_pass`, float32) when a request has its passes to itself,
from the numpy factors when it shares them.
Gaussian noise of std noise_multiplier * max_norm is added to every element: from the
stream of (`seed`, variable position, NOISE_STREAM) when a seed is given (the same bytes
on every replica), else fresh from the operating system's secure random source: noise
anyone could regenerate from a known default seed would protect nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions import summed
from pergrad.server.engine.reductions.factored import weighted_sum
from pergrad.server.engine.reductions.norms import squared
from pergrad.server.engine.reductions.random_streams import (
    gaussians,
    secure_gaussians,
    stream_key,
)
from pergrad.server.engine.slices import VariableSpec
from pergrad.server.errors import InvalidArgument

NOISE_STREAM = 2
# Norms below this count as this, so a zero gradient is scaled by 1, never by inf or NaN.
TINY_NORM = 1e-30


def clip_factors(norms: Any, max_norm: Any, ops: Any = np) -> Any:
    """min(1, max_norm / ||g_b||) for each example: the one clip formula, on numpy arrays
    (shared passes), or with `ops=tf.math` on tensors inside the pass (`in_pass`)."""
    return ops.minimum(1.0, max_norm / ops.maximum(norms, TINY_NORM))


class ClippedSum:
    IN_PASS_CLIP = True

    def __init__(
        self,
        variables: Sequence[VariableSpec],
        *,
        max_norm: float,
        noise_multiplier: float,
        seed: int | None,
    ) -> None:
        self._variables = variables
        self.max_norm = float(max_norm)
        self._noise = float(noise_multiplier)
        if self._noise * self.max_norm > np.finfo(np.float32).max:
            raise InvalidArgument(
                f"noise_multiplier * max_norm = {self._noise * self.max_norm:g} overflows "
                "float32, the sums' dtype: lower one of them"
            )
        self._seed = seed
        self._sums = {v.name: np.zeros(v.shape, np.float32) for v in variables}
        self._norms: list[np.ndarray] = []

    def add(self, grads: Mapping[str, Grad]) -> None:
        norms = np.sqrt(summed(squared(self._variables, grads).values()))
        scale = clip_factors(norms, self.max_norm)
        for v in self._variables:
            self._sums[v.name] += weighted_sum(grads[v.name], scale, v.shape)
        self._norms.append(norms)

    def add_in_pass(
        self, squares: Mapping[str, np.ndarray], sums: Mapping[str, np.ndarray]
    ) -> None:
        """One slice's squared norms and clipped sums per variable, from the pass itself."""
        self._norms.append(np.sqrt(summed(s.astype(np.float64) for s in squares.values())))
        for name, total in sums.items():
            self._sums[name] += total

    def _standard_noise(self) -> list[np.ndarray]:
        """Each variable's standard Gaussians, flat, made together (one array for them all)."""
        counts = [int(np.prod(v.shape)) for v in self._variables]
        if self._seed is None:
            return secure_gaussians(counts)
        keys = [stream_key(self._seed, v.index, NOISE_STREAM) for v in self._variables]
        return gaussians(keys, counts)

    def finish(self) -> dict[str, Any]:
        norms = np.concatenate(self._norms)
        if self._noise:
            std = np.float32(self._noise * self.max_norm)
            for v, noise in zip(self._variables, self._standard_noise(), strict=True):
                self._sums[v.name] += std * noise.reshape(v.shape)
        return {
            "clipped_sum": self._sums,
            "norms": norms.astype(np.float32),
            "num_clipped": int((norms > self.max_norm).sum()),
        }


REDUCTION = ClippedSum
