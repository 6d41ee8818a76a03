"""The wire contract's random numbers, written from gradient_service.proto's text alone.

Plain Python integers and `math`, one entry at a time: slow and obviously the text, so
that a projection matrix or seeded noise the server makes can be checked against what any
other client would make from the same seed.
"""

from __future__ import annotations

import math

import numpy as np

MASK = (1 << 64) - 1


def mix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def key(seed: int, index: int, stream: int) -> int:
    return mix(mix(mix(seed) ^ index) ^ stream)


def bits(k: int, n: int) -> int:
    return mix(k ^ n)


def rademacher(k: int, n: int) -> float:
    return -1.0 if (bits(k, n // 64) >> (n % 64)) & 1 else 1.0


def gaussian(k: int, n: int) -> float:
    word = bits(k, n // 2)
    u1 = ((word >> 32) + 0.5) / 2**32
    u2 = ((word & 0xFFFFFFFF) + 0.5) / 2**32
    radius, angle = math.sqrt(-2 * math.log(u1)), 2 * math.pi * u2
    return radius * (math.cos(angle) if n % 2 == 0 else math.sin(angle))


def matrix(seed: int, index: int, stream: int, rows: int, columns: int, kind: str) -> np.ndarray:
    entry = {"rademacher": rademacher, "gaussian": gaussian}[kind]
    k = key(seed, index, stream)
    return np.array([[entry(k, r * columns + c) for c in range(columns)] for r in range(rows)])


def projection_matrix(
    seed: int, index: int, shape: tuple[int, ...], dim: int, kind: str
) -> np.ndarray:
    """R_v, [dim, P]: Kronecker rows u_m (x) w_m for a rank-2 variable, else dense."""
    size = math.prod(shape)
    if len(shape) != 2:
        return matrix(seed, index, 0, dim, size, kind)
    u = matrix(seed, index, 0, dim, shape[0], kind)
    w = matrix(seed, index, 1, dim, shape[1], kind)
    return (u[:, :, None] * w[:, None, :]).reshape(dim, size)
