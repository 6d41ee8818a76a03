"""PROJECT: each example's gradient through one fixed random map to `dim` numbers
(TRAK-style features, sketching). projections_b = R g_b / sqrt(dim), so that
E ||projections_b||^2 = ||g_b||^2.

R is the same on every call and replica for a given (seed, dim, kind). For a Dense
kernel or an embedding table its rows are Kronecker products u_m (x) w_m of random
vectors, so for grad = sum_t a_t (x) g_t each feature is sum_t (u_m . a_t)(w_m . g_t):
cost B T dim (I + J), never I x J per example. Other variables use a dense R, cached.
Entries of u, w and R are Rademacher (+-1) or standard Gaussian.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad, Outer, Scatter
from pergrad.server.engine.reductions import Selected, generator
from pergrad.server.engine.reductions.factored import blocks
from pergrad.server.errors import InvalidArgument

KINDS = ("rademacher", "gaussian")
MAX_DIM = 1 << 16


@functools.lru_cache(maxsize=32)
def random_matrix(
    seed: int, index: int, stream: int, rows: int, cols: int, kind: str
) -> np.ndarray:
    rng = generator(seed, index, stream)
    if kind == "rademacher":
        matrix = rng.integers(0, 2, size=(rows, cols), dtype=np.int8).astype(np.float32) * 2 - 1
    else:
        matrix = rng.standard_normal((rows, cols), dtype=np.float32)
    matrix.flags.writeable = False
    return matrix


class Project:
    def __init__(
        self,
        variables: Sequence[Selected],
        *,
        dim: int | None = None,
        seed: int = 0,
        kind: str = "rademacher",
    ) -> None:
        if dim is None or not 1 <= dim <= MAX_DIM:
            raise InvalidArgument(f"dim: project needs 1 <= dim <= {MAX_DIM}, got {dim}")
        if kind not in KINDS:
            raise InvalidArgument(f"projection: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        self._variables = variables
        self._dim, self._seed, self._kind = int(dim), int(seed), kind
        self._parts: list[np.ndarray] = []

    def _matrix(self, variable: Selected, stream: int, cols: int) -> np.ndarray:
        return random_matrix(self._seed, variable.index, stream, self._dim, cols, self._kind)

    def _project(self, variable: Selected, grad: Grad) -> np.ndarray:
        if isinstance(grad, Outer):
            u = self._matrix(variable, 0, grad.a.shape[-1])
            w = self._matrix(variable, 1, grad.g.shape[-1])
            return np.einsum("btm,btm->bm", grad.a @ u.T, grad.g @ w.T)
        if isinstance(grad, Scatter):
            u = self._matrix(variable, 0, variable.shape[0])
            w = self._matrix(variable, 1, variable.shape[-1])
            return np.einsum("btm,btm->bm", u.T[grad.ids], grad.g @ w.T)
        matrix = self._matrix(variable, 0, int(np.prod(variable.shape)))
        return np.concatenate([b @ matrix.T for b in blocks(grad, variable.shape, variable.dtype)])

    def add(self, grads: Mapping[str, Grad]) -> None:
        self._parts.append(sum(self._project(v, grads[v.name]) for v in self._variables))

    def finish(self) -> dict[str, Any]:
        projections = np.concatenate(self._parts) / np.sqrt(self._dim)
        return {"projections": projections.astype(np.float32)}
