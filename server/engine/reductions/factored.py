"""Batch statistics of per-example gradients, computed from their factored form.

Each function takes one variable's numpy per-example gradient (a dense [n, *shape]
array, `Outer` or `Scatter`, see `grads.py`) and avoids forming the [n, *shape] tensor
where the algebra allows:
- Outer with one step: ||a (x) g||^2 = ||a||^2 ||g||^2 (Goodfellow 2015); with T steps,
  <A A^T, G G^T> when T (I + J) < I J (Li et al. 2021, ghost clipping).
- Scatter: ||dE||^2 = sum over step pairs with the same id of g_t . g_s.
- Tied (a table used as a lookup and as an output projection): both parts' norms and twice
  their inner product (`in_pass.py` states it).
- sums weighted per example: (w a)^T g, one matrix product.
Where no shortcut exists, examples are formed a block at a time (`BLOCK_BYTES`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pergrad.server.engine.grads import (
    Factored,
    Grad,
    Outer,
    Scatter,
    Tied,
    examples,
    materialize,
    rows,
)

BLOCK_BYTES = 16 << 20


def blocks(grad: Grad, shape: tuple[int, ...], dtype: np.dtype) -> Iterator[np.ndarray]:
    """The per-example gradients as [m, P] arrays, a block of examples at a time."""
    count = examples(grad)
    if not isinstance(grad, Factored):
        yield grad.reshape(count, -1)
        return
    step = max(1, BLOCK_BYTES // (int(np.prod(shape)) * dtype.itemsize))
    buffer = np.empty((min(step, count), *shape), dtype)
    for start in range(0, count, step):
        stop = min(start + step, count)
        out = buffer[: stop - start]
        materialize(rows(grad, slice(start, stop)), out)
        yield out.reshape(stop - start, -1)


def _ghost(grad: Outer) -> bool:
    steps, inputs, outputs = grad.a.shape[1], grad.a.shape[2], grad.g.shape[2]
    return steps * (inputs + outputs) < inputs * outputs


def squared_norms(grad: Grad, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """||grad_b||^2 for each example b, in float64."""
    if isinstance(grad, Tied):
        parts = (
            squared_norms(grad.lookup, shape, dtype),
            squared_norms(grad.projection, shape, dtype),
        )
        return parts[0] + parts[1] + 2 * _tied_cross(grad.lookup, grad.projection)
    if isinstance(grad, Outer) and grad.a.shape[1] == 1:
        a, g = grad.a[:, 0].astype(np.float64), grad.g[:, 0].astype(np.float64)
        return np.square(a).sum(1) * np.square(g).sum(1)
    if isinstance(grad, Outer) and _ghost(grad):
        a, g = grad.a.astype(np.float64), grad.g.astype(np.float64)
        return np.einsum("bts,bts->b", a @ a.transpose(0, 2, 1), g @ g.transpose(0, 2, 1))
    if isinstance(grad, Scatter):
        g = grad.g.astype(np.float64)
        same = grad.ids[:, :, None] == grad.ids[:, None, :]
        return np.einsum("bts,bts->b", g @ g.transpose(0, 2, 1), same)
    return np.concatenate(
        [np.square(b, dtype=np.float64).sum(1) for b in blocks(grad, shape, dtype)]
    )


def _tied_cross(lookup: Scatter, projection: Outer) -> np.ndarray:
    """<lookup_b, projection_b> for each example b, in float64."""
    g, h = lookup.g.astype(np.float64), projection.g.astype(np.float64)
    at_ids = np.take_along_axis(projection.a, lookup.ids[:, None, :], axis=2)  # [B, S, T]
    return np.einsum("bts,bst->b", g @ h.transpose(0, 2, 1), at_ids.astype(np.float64))


def weighted_sum(grad: Grad, weights: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """sum_b weights_b * grad_b, shaped like the variable."""
    weights = weights.astype(np.float32)
    if isinstance(grad, Tied):
        return weighted_sum(grad.lookup, weights, shape) + weighted_sum(
            grad.projection, weights, shape
        )
    if isinstance(grad, Outer):  # tensordot: one contiguous GEMM, 4-6x a.T @ g here
        scaled = grad.a * weights[:, None, None]
        return np.tensordot(scaled, grad.g, axes=([0, 1], [0, 1])).reshape(shape)
    if isinstance(grad, Scatter):
        total = np.zeros(shape, np.float32)
        scaled = grad.g * weights[:, None, None]
        np.add.at(total, grad.ids.ravel(), scaled.reshape(-1, shape[-1]))
        return total
    return np.tensordot(weights, grad, axes=1)


def sum_of_squares(grad: Grad, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """sum_b grad_b ** 2 elementwise, shaped like the variable."""
    if isinstance(grad, Outer) and grad.a.shape[1] == 1:
        a, g = grad.a[:, 0], grad.g[:, 0]
        return (np.square(a).T @ np.square(g)).reshape(shape)
    total = np.zeros(int(np.prod(shape)), np.float32)
    for block in blocks(grad, shape, dtype):
        total += np.square(block).sum(0)
    return total.reshape(shape)


def dots(grad: Grad, reference: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """<grad_b, reference_k> for each example b and reference k: [n, K]."""
    count, shape = examples(grad), reference.shape[1:]
    if isinstance(grad, Outer) and grad.a.shape[1] == 1:
        return _dense_dots(grad.a[:, 0], grad.g[:, 0], reference)
    flat = reference.reshape(reference.shape[0], -1).T
    return np.concatenate([b @ flat for b in blocks(grad, shape, dtype)]).reshape(count, -1)


def _dense_dots(a: np.ndarray, g: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """a_b^T R_k g_b for each example b and reference k, [n, K], a block of examples at a
    time: each block's [m, K, out] products stay within BLOCK_BYTES."""
    count, inputs, outputs, k = a.shape[0], a.shape[1], g.shape[1], reference.shape[0]
    kernels = np.moveaxis(reference.reshape(k, inputs, outputs), 1, 0).reshape(inputs, -1)
    if count == 0:
        return np.zeros((0, k), np.result_type(a, kernels, g))
    step = max(1, BLOCK_BYTES // (k * outputs * np.result_type(a, kernels).itemsize))
    parts = [
        np.einsum(
            "bkj,bj->bk", (a[s : s + step] @ kernels).reshape(-1, k, outputs), g[s : s + step]
        )
        for s in range(0, count, step)
    ]
    return np.concatenate(parts)
