"""PROJECT: each example's gradient through one fixed random map to `dim` numbers
(TRAK-style features, sketching). projections_b = sum_v R_v g_bv / sqrt(dim), so that
E ||projections_b||^2 = ||g_b||^2.

R_v is a pure function of (seed, variable position, dim, kind) (`random_streams`, as the
wire contract defines it), the same on every call and replica. For a variable of rank 2
[I, J] its rows are Kronecker products u_m (x) w_m, so for grad = sum_t a_t (x) g_t each
feature is sum_t (u_m . a_t)(w_m . g_t): cost B T dim (I + J), never I x J per example.
Other variables use a dense [dim, P] matrix.

Features are computed a block of rows of R at a time, so working memory stays within
`BLOCK_BYTES` whatever `dim` is. Whole matrices are kept in a cache bounded by bytes
(`MatrixCache`): memory stays bounded whatever seeds callers send, and a repeated seed
reuses its matrices.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.cores import on_cores
from pergrad.server.engine.grads import Grad, Outer, Scatter, Tied
from pergrad.server.engine.reductions import summed
from pergrad.server.engine.reductions.factored import blocks, examples
from pergrad.server.engine.reductions.random_streams import matrix_rows
from pergrad.server.engine.slices import VariableSpec

BLOCK_BYTES = 16 << 20
DEFAULT_CACHE_BYTES = 256 << 20

MatrixKey = tuple[int, int, int, str, int, int]  # seed, index, stream, kind, dim, columns


class MatrixCache:
    """Whole random matrices, least recently used out first, within `max_bytes`; one
    larger than a quarter of that is not kept (its rows are made as they are needed)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._matrices: OrderedDict[MatrixKey, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: MatrixKey) -> np.ndarray | None:
        seed, index, stream, kind, dim, columns = key
        if 4 * dim * columns * 4 > self.max_bytes:
            return None
        with self._lock:
            if key in self._matrices:
                self._matrices.move_to_end(key)
                return self._matrices[key]
        matrix = matrix_rows(seed, index, stream, rows=range(dim), columns=columns, kind=kind)
        matrix.flags.writeable = False
        with self._lock:
            if key not in self._matrices:
                self._matrices[key] = matrix
                self._bytes += matrix.nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._matrices.popitem(last=False)
                self._bytes -= dropped.nbytes
        return matrix


CACHE = MatrixCache()


class Project:
    def __init__(
        self,
        variables: Sequence[VariableSpec],
        *,
        dim: int,
        seed: int | None,
        projection: str,
        cache: MatrixCache = CACHE,
    ) -> None:
        self._variables = variables
        self._dim, self._seed, self._kind = int(dim), int(seed or 0), projection
        self._cache = cache
        self._parts: list[np.ndarray] = []

    def _key(self, variable: VariableSpec, stream: int, columns: int) -> MatrixKey:
        return self._seed, variable.index, stream, self._kind, self._dim, columns

    def _made_first(self, variable: VariableSpec, stream: int, columns: int) -> None:
        """Make the whole matrix now, on every core, if the cache keeps it: the blocks'
        rows split over the cores (`_by_row_blocks`) would each make it on one."""
        self._cache.get(self._key(variable, stream, columns))

    def _rows(self, variable: VariableSpec, stream: int, columns: int, rows: slice) -> np.ndarray:
        """Rows of the [dim, columns] matrix of `variable`'s `stream`."""
        whole = self._cache.get(self._key(variable, stream, columns))
        if whole is not None:
            return whole[rows]
        span = range(rows.start, rows.stop)
        return matrix_rows(
            self._seed, variable.index, stream, rows=span, columns=columns, kind=self._kind
        )

    def _by_row_blocks(
        self, out: np.ndarray, per_row: int, features: Callable[[slice], np.ndarray]
    ) -> np.ndarray:
        """out[:, rows] += features(rows) for blocks of rows of about BLOCK_BYTES each,
        where one row of R costs `per_row` floats of working memory; each block's rows
        split over the cores (numpy's BLAS runs on one thread: `one_blas_thread`)."""
        step = max(1, BLOCK_BYTES // (4 * per_row))
        for start in range(0, self._dim, step):
            block = min(step, self._dim - start)

            def fill(part: slice, start: int = start) -> None:
                rows = slice(start + part.start, start + part.stop)
                out[:, rows] += features(rows)

            on_cores(block, fill, serial=block < 2)
        return out

    def _project(self, variable: VariableSpec, grad: Grad) -> np.ndarray:
        if isinstance(grad, Tied):  # linear: the sum of its parts' projections
            return summed(self._project(variable, part) for part in grad)
        out = np.zeros((examples(grad), self._dim), np.float32)
        if len(variable.shape) != 2:
            flat = np.concatenate(list(blocks(grad, variable.shape, variable.dtype)))
            columns = flat.shape[1]
            self._made_first(variable, 0, columns)
            return self._by_row_blocks(
                out, columns, lambda rows: flat @ self._rows(variable, 0, columns, rows).T
            )
        inputs, outputs = variable.shape

        def u(rows: slice) -> np.ndarray:
            return self._rows(variable, 0, inputs, rows)

        def w(rows: slice) -> np.ndarray:
            return self._rows(variable, 1, outputs, rows)

        self._made_first(variable, 0, inputs)
        self._made_first(variable, 1, outputs)

        if isinstance(grad, Outer):
            steps = grad.a.shape[0] * grad.a.shape[1]
            return self._by_row_blocks(
                out,
                inputs + outputs + 2 * steps,
                lambda r: np.einsum("btm,btm->bm", grad.a @ u(r).T, grad.g @ w(r).T),
            )
        if isinstance(grad, Scatter):
            steps = grad.ids.shape[0] * grad.ids.shape[1]
            return self._by_row_blocks(
                out,
                inputs + outputs + 2 * steps,
                lambda r: np.einsum("btm,btm->bm", u(r).T[grad.ids], grad.g @ w(r).T),
            )
        dense = grad.reshape(-1, inputs, outputs)
        return self._by_row_blocks(
            out,
            inputs + outputs + dense.shape[0] * inputs,
            lambda r: np.einsum("bim,mi->bm", dense @ w(r).T, u(r)),
        )

    def add(self, grads: Mapping[str, Grad]) -> None:
        self._parts.append(summed(self._project(v, grads[v.name]) for v in self._variables))

    def finish(self) -> dict[str, Any]:
        projections = np.concatenate(self._parts) / np.sqrt(self._dim)
        return {"projections": projections.astype(np.float32)}


REDUCTION = Project
