"""Counter-based random numbers: a pure function of (seed, index, stream, position).

The wire contract (`Reduction` in gradient_service.proto) defines them, so any client can
regenerate a projection matrix, and any block of it can be made on its own, in any order,
without holding the rest:

    mix(x)  = splitmix64's finalizer (below), arithmetic modulo 2^64
    key     = mix(mix(mix(seed) ^ index) ^ stream)
    bits(n) = mix(key ^ n)
    Rademacher entry n: +1 if bit (n mod 64) of bits(n div 64) is 0, else -1
    Gaussian entries 2k, 2k+1: Box-Muller on the two 32-bit halves of bits(k), in float64,
    each rounded once to float32

Measured here (numpy, 4M entries): Rademacher 0.3 ns per entry, Gaussian ~10 ns, against
numpy's own PCG64 integers 2.1 ns and standard_normal 7.8 ns; mnist_mlp's 101,770 noise
entries on 2 cores, 13 ns each (26 with libm's cos and sin, before `sincos`). Box-Muller
on 32-bit uniforms bounds |entry| by sqrt(-2 ln 2^-33) = 6.8 (a tail mass of 1e-11 is
cut).
Fresh noise (no seed) runs the same Gaussian rule on bits from the operating system's
cryptographically secure source instead of `bits`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from pergrad.server.engine.cores import on_cores
from pergrad.server.engine.reductions.sincos import cos_sin

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64
# Streams this long or longer fill on every core (below, handing over costs more).
PARALLEL_ENTRIES = 1 << 15
# Words turned into Gaussians at a time: Box-Muller's float64 temporaries take ~60 bytes
# an entry, so a model's noise made whole (23.6M entries: 1.35 GB), or one long stream,
# is made by blocks.
BLOCK_WORDS = 1 << 19


def _mix_int(x: int) -> int:
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array, in place (numpy wraps modulo 2^64)."""
    z += _U64(_GOLDEN)
    z ^= z >> _U64(30)
    z *= _U64(_M1)
    z ^= z >> _U64(27)
    z *= _U64(_M2)
    z ^= z >> _U64(31)
    return z


def stream_key(seed: int, index: int, stream: int) -> int:
    """The key of one variable's (`index`) stream `stream` under `seed`."""
    return _mix_int(_mix_int(_mix_int(seed & _MASK) ^ index) ^ stream)


def _bits(key: int, start: int, count: int) -> np.ndarray:
    counters = np.arange(start, start + count, dtype=np.uint64)
    counters ^= _U64(key)
    return _mix(counters)


def _box_muller(bits: np.ndarray) -> np.ndarray:
    """Two standard Gaussians from each 64-bit word: [2 * len(bits)] float32, computed in
    float64 in the contract's order and rounded once. numpy's float64 ln is within an ulp
    and `cos_sin` within 2.2 (0.5% of its results an ulp off libm's), as the contract
    allows: an entry then differs from a libm's only when it lies within that ulp of a
    float32 rounding boundary (none in 134M entries sampled)."""
    radius = (bits >> _U64(32)).astype(np.float64)
    radius += 0.5
    radius *= 2.0**-32
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle = (bits & _U64(0xFFFFFFFF)).astype(np.float64)
    angle += 0.5
    angle *= 2.0**-32
    angle *= 2.0 * np.pi
    cos, sin = cos_sin(angle)
    pairs = np.empty((len(bits), 2), np.float32)
    pairs[:, 0] = radius * cos
    pairs[:, 1] = radius * sin
    return pairs.reshape(-1)


def rademacher(key: int, start: int, count: int) -> np.ndarray:
    """Entries [start, start + count) of the Rademacher stream `key`, float32 +-1."""
    first = start // 64
    words = _bits(key, first, (start + count + 63) // 64 - first)
    signs = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    signs = signs[start - 64 * first : start - 64 * first + count]
    return np.float32(1.0) - np.float32(2.0) * signs.astype(np.float32)


def gaussian(key: int, start: int, count: int) -> np.ndarray:
    """Entries [start, start + count) of the Gaussian stream `key`, float32: each entry a
    function of its index alone, so parts of the range fill on every core at once, each
    by blocks (a projection's cached matrix is one stream of up to millions of entries)."""
    out = np.empty(count, np.float32)

    def fill(part: slice) -> None:
        for block in _blocks(part, 2 * BLOCK_WORDS):
            low = start + block.start
            first = low // 2
            words = _bits(key, first, (start + block.stop + 1) // 2 - first)
            out[block] = _box_muller(words)[low - 2 * first : low - 2 * first + len(out[block])]

    on_cores(count, fill, serial=count < PARALLEL_ENTRIES, align=2)
    return out


def _blocks(part: slice, size: int) -> list[slice]:
    """`part` in consecutive slices of at most `size` (even: pairs stay whole)."""
    return [slice(lo, min(lo + size, part.stop)) for lo in range(part.start, part.stop, size)]


def _slots(counts: Sequence[int]) -> tuple[list[int], int]:
    """Where each of `counts` entries starts in one array that holds them all, each at an
    even position (Gaussians come in pairs); the array's length."""
    starts, end = [], 0
    for count in counts:
        starts.append(end)
        end += 2 * ((count + 1) // 2)
    return starts, end


def gaussians(keys: Sequence[int], counts: Sequence[int]) -> list[np.ndarray]:
    """Entries [0, count) of each Gaussian stream `key` (a model's noise, a stream per
    variable), made as one array: one round of numpy calls for all the streams, where a
    stream made alone costs ~80 us of them however short it is (most biases)."""
    starts, total = _slots(counts)
    words = [(count + 1) // 2 for count in counts]
    counters = np.arange(total // 2, dtype=np.uint64)
    counters -= np.repeat(np.array(starts, dtype=np.uint64) // _U64(2), words)
    counters ^= np.repeat(np.array(keys, dtype=np.uint64), words)
    out = np.empty(total, np.float32)

    def fill(part: slice) -> None:
        for block in _blocks(part, BLOCK_WORDS):
            out[2 * block.start : 2 * block.stop] = _box_muller(_mix(counters[block]))

    on_cores(len(counters), fill, serial=total < PARALLEL_ENTRIES)
    return [out[start : start + count] for start, count in zip(starts, counts, strict=True)]


KINDS = {"rademacher": rademacher, "gaussian": gaussian}


def matrix_rows(
    seed: int, index: int, stream: int, *, rows: range, columns: int, kind: str
) -> np.ndarray:
    """Rows `rows` of the [*, columns] matrix of (seed, index, stream): float32."""
    entries = KINDS[kind](
        stream_key(seed, index, stream), rows.start * columns, len(rows) * columns
    )
    return entries.reshape(len(rows), columns)


def secure_gaussians(counts: Sequence[int]) -> list[np.ndarray]:
    """Standard Gaussians from the operating system's cryptographically secure source, a
    vector of each count, made as one array: each part's bytes drawn on its own core (the
    kernel makes them at ~3 ns a byte here, 1.2 ms for mnist_mlp's noise, with the GIL
    released)."""
    starts, total = _slots(counts)
    out = np.empty(total, np.float32)

    def fill(part: slice) -> None:
        for block in _blocks(part, 2 * BLOCK_WORDS):
            words = np.frombuffer(os.urandom(4 * len(out[block])), dtype="<u8")
            out[block] = _box_muller(words.astype(np.uint64, copy=False))

    on_cores(total, fill, serial=total < PARALLEL_ENTRIES, align=2)
    return [out[start : start + count] for start, count in zip(starts, counts, strict=True)]
