"""The wire contract's random numbers, written from gradient_service.proto's text alone.

Plain Python integers and `math`, one entry at a time: slow and obviously the text, so
that a projection matrix or seeded noise the server makes can be checked, bit for bit,
against what any other client would make from the same seed. TEXT is the proto's section
this module implements, word for word (tests/server/engine/test_random_streams.py holds it to
the proto), so the two cannot drift apart.
"""

from __future__ import annotations

import math

import numpy as np

TEXT = """\
Random numbers (PROJECT matrices, seeded CLIPPED_SUM noise) are a pure function of
(seed, index, stream, position), so any client can reproduce them; index is the
variable's position in ModelInfo.variables. With all integer arithmetic modulo 2^64 and
  mix(x) = z ^ (z >> 31), where z = x + 0x9E3779B97F4A7C15,
           z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9, z = (z ^ (z >> 27)) * 0x94D049BB133111EB
  key    = mix(mix(mix(seed) ^ index) ^ stream)
  bits(k) = mix(key ^ k)
entry n (row-major position: n = row * columns + column) of a matrix, or element n of
a noise tensor (row-major over the variable's shape), is:
  RADEMACHER: +1.0 if bit (n mod 64) of bits(n div 64) is 0, else -1.0, bit 0 being
              the least significant;
  GAUSSIAN:   entries 2k and 2k+1 are r cos(t) and r sin(t), where hi and lo are the
              upper and lower 32 bits of bits(k) and, in IEEE float64 arithmetic, each
              step rounded to float64 in this order:
                u1 = (hi + 0.5) * 2^-32, r = sqrt(-2 * ln(u1)),
                u2 = (lo + 0.5) * 2^-32, t = u2 * (2 * pi), 2 * pi being the float64
                nearest it (6.283185307179586),
              then r * cos(t) and r * sin(t) each rounded once, to nearest even, to
              float32. Every step but ln, cos and sin is exact or correctly rounded in
              IEEE arithmetic; a libm whose ln, cos or sin is off by an ulp of float64
              changes a float32 entry only when it lies within that ulp of a float32
              rounding boundary (about one entry in 2^28).
Seeded noise uses the GAUSSIAN rule.
"""

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


def gaussian(k: int, n: int) -> np.float32:
    word = bits(k, n // 2)
    hi, lo = word >> 32, word & 0xFFFFFFFF
    u1 = (hi + 0.5) * 2.0**-32
    r = math.sqrt(-2.0 * math.log(u1))
    u2 = (lo + 0.5) * 2.0**-32
    t = u2 * (2.0 * math.pi)
    return np.float32(r * math.cos(t) if n % 2 == 0 else r * math.sin(t))


def matrix(seed: int, index: int, stream: int, rows: int, columns: int, kind: str) -> np.ndarray:
    entry = {"rademacher": rademacher, "gaussian": gaussian}[kind]
    k = key(seed, index, stream)
    entries = [[entry(k, r * columns + c) for c in range(columns)] for r in range(rows)]
    return np.array(entries, dtype=np.float32)


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
