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

Rademacher entries are made here in numpy (0.3 ns an entry); Gaussian ones by the rule
compiled in `box_muller`. Box-Muller on 32-bit uniforms bounds |entry| by
sqrt(-2 ln 2^-33) = 6.8 (a tail mass of 1e-11 is cut).
Fresh noise (no seed) takes Box-Muller's uniforms from secure random words
(`secure_bits`), 53 bits each instead of 32 (`box_muller`): it is what DP-SGD runs on,
and owes no client a stream to regenerate.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from pergrad.server.engine.cores import on_cores
from pergrad.server.engine.reductions import box_muller

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64
# Gaussian streams this long or longer are counted on the device, each alone; shorter
# ones are made together from their counters: a compiled call costs ~0.1 ms beyond its
# work, and at 2^15 mnist_mlp's noise (100,352 entries and three short streams) took two
# (`benchmarks/noise.py`: 1.14-1.47 ms, against 0.82-1.09 in one).
ALONE_ENTRIES = 1 << 17
# cryptography writes a stream cipher's output a 64-byte block past its input's end.
_CHACHA_SLACK_WORDS = 8
# The keystream is ChaCha20 encrypting zeros: a block's zeros, read-only, for every call.
_ZEROS = bytes(8 * 2 * box_muller.BLOCK_WORDS)


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


def rademacher(key: int, start: int, count: int) -> np.ndarray:
    """Entries [start, start + count) of the Rademacher stream `key`, float32 +-1."""
    first = start // 64
    words = _bits(key, first, (start + count + 63) // 64 - first)
    signs = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    signs = signs[start - 64 * first : start - 64 * first + count]
    return np.float32(1.0) - np.float32(2.0) * signs.astype(np.float32)


def gaussian(key: int, start: int, count: int) -> np.ndarray:
    """Entries [start, start + count) of the Gaussian stream `key`, float32: each entry a
    function of its index alone (a projection's cached matrix is one stream of up to
    millions of entries, made by rows)."""
    first = start // 2
    pairs = box_muller.counted(key, first, (start + count + 1) // 2 - first)
    return pairs[start - 2 * first : start - 2 * first + count]


def _slots(counts: Sequence[int]) -> tuple[list[int], int]:
    """Where each of `counts` entries starts in one array that holds them all, each at an
    even position (Gaussians come in pairs); the array's length."""
    starts, end = [], 0
    for count in counts:
        starts.append(end)
        end += 2 * ((count + 1) // 2)
    return starts, end


def _together(keys: Sequence[int], counts: Sequence[int]) -> list[np.ndarray]:
    """Entries [0, count) of short streams, from one array of their keyed counters: one
    compiled call for them all, where each alone would pay one (most biases)."""
    starts, total = _slots(counts)
    words = [(count + 1) // 2 for count in counts]
    counters = np.arange(total // 2, dtype=np.uint64)
    counters -= np.repeat(np.array(starts, dtype=np.uint64) // _U64(2), words)
    counters ^= np.repeat(np.array(keys, dtype=np.uint64), words)
    out = box_muller.keyed(counters)
    return [out[start : start + count] for start, count in zip(starts, counts, strict=True)]


def gaussians(keys: Sequence[int], counts: Sequence[int]) -> list[np.ndarray]:
    """Entries [0, count) of each Gaussian stream `key` (a model's noise, a stream per
    variable): streams of ALONE_ENTRIES or more each counted on the device, the others
    together."""
    alone = [count >= ALONE_ENTRIES for count in counts]
    short = iter(
        _together(
            [k for k, a in zip(keys, alone, strict=True) if not a],
            [c for c, a in zip(counts, alone, strict=True) if not a],
        )
    )
    return [
        gaussian(key, 0, count) if a else next(short)
        for key, count, a in zip(keys, counts, alone, strict=True)
    ]


KINDS = {"rademacher": rademacher, "gaussian": gaussian}


def matrix_rows(
    seed: int, index: int, stream: int, *, rows: range, columns: int, kind: str
) -> np.ndarray:
    """Rows `rows` of the [*, columns] matrix of (seed, index, stream): float32."""
    entries = KINDS[kind](
        stream_key(seed, index, stream), rows.start * columns, len(rows) * columns
    )
    return entries.reshape(len(rows), columns)


def secure_bits(words: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """`words` random 64-bit words: ChaCha20's keystream under a key and nonce drawn from
    the operating system's secure source for this call alone (the construction the
    kernel's own generator uses: 0.3 ns a byte here into a warm buffer, getrandom 3.4;
    `benchmarks/noise.py`). Written into `scratch` (uint64, `words` + 8 long, `_scratch`)
    when given, so a caller making many blocks pays a fresh buffer's page faults once
    (they doubled the cipher's time)."""
    key, nonce = os.urandom(32), bytes(4) + os.urandom(12)  # block counter from 0
    out = _scratch(words) if scratch is None else scratch
    plaintext = _ZEROS if words <= len(_ZEROS) // 8 else bytes(8 * words)
    Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update_into(
        memoryview(plaintext)[: 8 * words], out.data.cast("B")
    )
    return out[:words]


def _scratch(words: int) -> np.ndarray:
    return np.empty(words + _CHACHA_SLACK_WORDS, np.uint64)


def secure_gaussians(counts: Sequence[int]) -> list[np.ndarray]:
    """Standard Gaussians from secure random bits (`secure_bits`, a word per entry), a
    vector of each count, made as one array a block at a time on every core: each block's
    words drawn as it is made, into the core's own scratch, so they stay in cache (a
    model's at once took 116 MB for 14.5M)."""
    starts, total = _slots(counts)
    out = np.empty(total, np.float32)
    blocks = range(0, total // 2, box_muller.BLOCK_WORDS)

    def fill(part: slice) -> None:
        scratch = _scratch(2 * min(box_muller.BLOCK_WORDS, total // 2))
        for lo in blocks[part]:
            pairs = min(box_muller.BLOCK_WORDS, total // 2 - lo)
            words = secure_bits(2 * pairs, scratch).reshape(pairs, 2)
            box_muller.secure(words, out[2 * lo : 2 * (lo + pairs)])

    on_cores(len(blocks), fill, serial=len(blocks) < 2)
    return [out[start : start + count] for start, count in zip(starts, counts, strict=True)]
