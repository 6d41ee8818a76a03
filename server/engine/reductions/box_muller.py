"""The wire contract's GAUSSIAN rule (`random_streams`) compiled by XLA into one loop:
splitmix64, then Box-Muller in float64 on each word's two 32-bit halves, rounded once to
float32; and fresh secure noise, by Box-Muller on finer uniforms (`_fine`). Both with
`ln` and `cos_sin` made of products, sums and table reads, so the loop vectorises; a
stream's blocks run on every core (`_by_blocks`).

numpy ran the same rule as ~30 whole-array passes; here a model's 14.5M seeded entries
take 36-42 ms on 2 cores where numpy's took 426-690, and match a numpy rule with libm's
ln, cos and sin bit for bit on all 14.5M (`benchmarks/noise.py`). Still 2.5-2.9 ns an
entry, 5-6x writing the floats (fresh noise 4.1-4.4 ns, with ChaCha20's words): float64
ln, cos and sin of every word, ~3 ns of one core's time.

Words are made a block at a time, at one of a few fixed sizes (XLA compiles each shape
once): a stream longer than a block in whole blocks counted on the device, shorter
streams together from their counters, fresh noise from the secure words given.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from pergrad.server.engine.cores import on_cores
from pergrad.server.engine.flat_call import FlatCall
from pergrad.server.engine.reductions.ln import ln
from pergrad.server.engine.reductions.sincos import cos_sin

# splitmix64's constants (the contract's mix).
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Words a compiled call turns into Gaussians at most, and at least (a shorter call is
# padded): sizes in between are powers of 4, so at most 5 shapes compile per kind.
BLOCK_WORDS = 1 << 18
SMALLEST_WORDS = 1 << 10


def _u64(value: int) -> tf.Tensor:
    return tf.constant(value, tf.uint64)


def _mix(z: tf.Tensor) -> tf.Tensor:
    """splitmix64's finalizer, modulo 2^64."""
    z = z + _u64(_GOLDEN)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(30))) * _u64(_M1)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(27))) * _u64(_M2)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(31)))


def _rounded(value: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    """`value` (float64) as stored, its bits through an XOR with `zero`, a uint64 input the
    compiler cannot see is 0: XLA lets LLVM fuse a product into the sum that reads it
    (FMA), which skips the product's rounding."""
    return tf.bitcast(tf.bitwise.bitwise_xor(tf.bitcast(value, tf.uint64), zero), tf.float64)


def _pairs(u1: tf.Tensor, u2: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    """Box-Muller's two entries, r cos t and r sin t, from uniforms u1 in (0, 1] and u2
    in [0, 1), float64, each rounded once to float32: as one complex64, whose bytes are
    the two entries in order, copied out at once. As two outputs, XLA made each in a
    loop of its own, and the kernels that mix their words made them twice: seeded noise
    for 14.5M entries took 90-106 ms, against 53 then (`benchmarks/noise.py`).

    t = u2 * 2 pi is rounded before `cos_sin` reads it (`_rounded`), as the contract
    says: fused into `cos_sin`'s t - node, the unrounded product put entry 6,506,615 of
    stream key(7, 0, 2), a cosine within 1e-10 of zero, 3 float32 ulps off."""
    radius = tf.sqrt(-2.0 * ln(u1))
    cos, sin = cos_sin(_rounded(u2 * (2.0 * np.pi), zero))
    return tf.complex(tf.cast(radius * cos, tf.float32), tf.cast(radius * sin, tf.float32))


def _halves(words: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The contract's uniforms: (hi + 0.5) 2^-32 and (lo + 0.5) 2^-32 of each word."""
    high = tf.cast(tf.bitwise.right_shift(words, _u64(32)), tf.float64)
    low = tf.cast(tf.bitwise.bitwise_and(words, _u64(0xFFFFFFFF)), tf.float64)
    return (high + 0.5) * 2.0**-32, (low + 0.5) * 2.0**-32


def _fine(words: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Fresh noise's uniforms, 53 bits each from a pair of words: u1 = (a + 1) 2^-53 in
    (0, 1], so |entry| <= sqrt(-2 ln 2^-53) = 8.57 (a tail mass of 1e-17 cut, where the
    contract's 32-bit u1 cuts 1e-11 at 6.8), and u2 = b 2^-53. Each column is sliced
    before it is shifted: shifted and converted whole, then sliced, XLA's loop over the
    [n, 2] shape vectorised worse, and 14.5M fresh entries took 94-101 ms, against 78-82
    (`benchmarks/noise.py`)."""
    a, b = (tf.cast(tf.bitwise.right_shift(words[:, i], _u64(11)), tf.float64) for i in (0, 1))
    return (a + 1.0) * 2.0**-53, b * 2.0**-53


def _counted(first: tf.Tensor, key: tf.Tensor, zero: tf.Tensor, size: int) -> tf.Tensor:
    """Words first .. first + size - 1 of the stream `key`: bits(k) = mix(key ^ k)."""
    counters = tf.cast(tf.range(size, dtype=tf.int64), tf.uint64) + first
    return _pairs(*_halves(_mix(tf.bitwise.bitwise_xor(counters, key))), zero)


def _keyed(keyed_counters: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    return _pairs(*_halves(_mix(keyed_counters)), zero)


def _secure(word_pairs: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    return _pairs(*_fine(word_pairs), zero)


_SCALAR = tf.TensorSpec([], tf.uint64)
# Each kernel's signature at a compiled size, and what it takes as fixed: a stream's block
# is counted on the device from (first, key); the others take their words. Each takes
# `_ZERO` last (`_rounded`).
_SIGNATURES = {
    _counted: lambda size: ([_SCALAR, _SCALAR, _SCALAR], {"size": size}),
    _keyed: lambda size: ([tf.TensorSpec([size], tf.uint64), _SCALAR], {}),
    _secure: lambda size: ([tf.TensorSpec([size, 2], tf.uint64), _SCALAR], {}),
}
_ZERO = tf.constant(0, tf.uint64)
_KERNELS: dict[tuple[Callable[..., Any], int], FlatCall] = {}
_KERNELS_LOCK = threading.Lock()


def _compiled(kernel: Callable[..., Any], size: int) -> FlatCall:
    """`kernel` compiled by XLA for `size` words, called flat (`FlatCall`): through
    tf.function's dispatch and `tf.constant`, a model's fresh noise spent ~0.6 ms of a
    mnist_mlp DP step binding and copying its words. Made once, under a lock: a stream's
    first blocks ask for it from every core at once."""
    with _KERNELS_LOCK:
        if (kernel, size) not in _KERNELS:
            signature, fixed = _SIGNATURES[kernel](size)
            function = functools.partial(kernel, **fixed) if fixed else kernel
            _KERNELS[kernel, size] = FlatCall(
                tf.function(function, input_signature=signature, jit_compile=True)
            )
        return _KERNELS[kernel, size]


def _size(words: int) -> int:
    """The compiled size that holds `words` (<= BLOCK_WORDS): a power of 4 from SMALLEST."""
    size = SMALLEST_WORDS
    while size < words:
        size *= 4
    return min(size, BLOCK_WORDS)


def _into(out: np.ndarray, lo: int, pairs: tf.Tensor, count: int) -> None:
    """Words lo .. lo + count - 1's entries (`_pairs`) into `out` (entries 2 lo ...)."""
    out[2 * lo : 2 * (lo + count)] = pairs.numpy()[:count].view(np.float32)


def _by_blocks(words: int, block: Callable[[int, int], tf.Tensor], out: np.ndarray) -> np.ndarray:
    """`block(lo, count)`'s entries for words lo .. lo + count - 1, each block of words
    into `out`, the blocks on every core: XLA spreads one kernel over the cores only in
    part, and a model's 14.5M seeded entries took 45-48 ms block after block, 40-42 on
    both cores (`benchmarks/noise.py`, three runs of each alternating)."""
    blocks = range(0, words, BLOCK_WORDS)

    def fill(part: slice) -> None:
        for lo in blocks[part]:
            count = min(BLOCK_WORDS, words - lo)
            _into(out, lo, block(lo, count), count)

    on_cores(len(blocks), fill, serial=len(blocks) < 2)
    return out


def counted(key: int, first: int, words: int) -> np.ndarray:
    """Entries 2 first .. 2 (first + words) - 1 of the Gaussian stream `key`, float32."""

    def block(lo: int, count: int) -> tf.Tensor:
        start = _u64((first + lo) % (1 << 64))
        return _compiled(_counted, _size(count))(start, _u64(key), _ZERO)

    return _by_blocks(words, block, np.empty(2 * words, np.float32))


def _given(
    kernel: Callable[[tf.Tensor, tf.Tensor], Any],
    words: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """`kernel`'s two entries for each row of `words` (uint64), into `out` (a new array if
    None)."""

    def block(lo: int, count: int) -> tf.Tensor:
        rows, size = words[lo : lo + count], _size(count)
        if size > count:  # the last block, padded to a compiled size
            padding = np.zeros((size - count, *words.shape[1:]), np.uint64)
            rows = np.concatenate([rows, padding])
        return _compiled(kernel, size)(rows, _ZERO)

    out = np.empty(2 * len(words), np.float32) if out is None else out
    return _by_blocks(len(words), block, out)


def keyed(keyed_counters: np.ndarray) -> np.ndarray:
    """Two entries for each `key ^ k` given (uint64): those of word k of stream `key`."""
    return _given(_keyed, keyed_counters)


def secure(word_pairs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Two Gaussians for each pair of secure random 64-bit words ([n, 2] uint64), from
    53-bit uniforms (`_fine`), into `out` if given."""
    return _given(_secure, word_pairs, out)
