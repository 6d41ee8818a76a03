"""ln of Box-Muller's float64 uniforms in TensorFlow ops, so XLA fuses it into one
vectorised loop with the rest of the Gaussian rule (`box_muller`): its own `log` calls
libm an element at a time, ~4 ns each here, the rule's largest cost after cos and sin.

The algorithm and constants are fdlibm's `__ieee754_log` (Sun, 1993; what glibc's and
musl's logs descend from), for positive normal numbers only: x = 2^k m with m in
[sqrt(2)/2, sqrt(2)), f = m - 1, s = f / (2 + f), and ln(1 + f) from a degree-14
polynomial in s, with ln(2) split in two so that k ln(2) adds no error. fdlibm bounds the
error by 1 ulp; measured against numpy's on 10M contract uniforms, 7% differ by an ulp
and none by more.
"""

from __future__ import annotations

import tensorflow as tf

_LN2_HI = 6.93147180369123816490e-01  # ln(2)'s upper 32 bits: k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_LG = (
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
_LOW_WORD = 0xFFFFFFFF


def ln(x: tf.Tensor) -> tf.Tensor:
    """ln(x) for positive normal float64 `x` (Box-Muller's (hi + 0.5) 2^-32), within 1 ulp:
    fdlibm's three cases (m within 2^-20 of 1; m in the middle of its range; the rest),
    each computed and the right one chosen, as a vector loop must."""
    bits = tf.bitcast(x, tf.uint64)
    high = tf.cast(tf.bitwise.right_shift(bits, tf.constant(32, tf.uint64)), tf.int64)
    mantissa = tf.bitwise.bitwise_and(high, 0x000FFFFF)
    # 0x100000 where m >= sqrt(2): then x is taken as 2^(k+1) (m / 2).
    halve = tf.bitwise.bitwise_and(mantissa + 0x95F64, 0x100000)
    high_of_m = tf.bitwise.bitwise_or(mantissa, tf.bitwise.bitwise_xor(halve, 0x3FF00000))
    m = tf.bitcast(
        tf.bitwise.bitwise_or(
            tf.bitwise.left_shift(tf.cast(high_of_m, tf.uint64), tf.constant(32, tf.uint64)),
            tf.bitwise.bitwise_and(bits, tf.constant(_LOW_WORD, tf.uint64)),
        ),
        tf.float64,
    )
    k = tf.bitwise.right_shift(high, 20) - 1023 + tf.bitwise.right_shift(halve, 20)
    dk = tf.cast(k, tf.float64)
    f = m - 1.0
    # s > -0.18 always, so the maximum changes no bit: it gives the division one user,
    # which XLA then fuses into the loop. With three users, XLA made the division in a
    # loop of its own and stored it: 14.5M seeded entries took 38-44 ms, against 35-38
    # (`benchmarks/noise.py`, five runs of each alternating).
    s = tf.maximum(f / (2.0 + f), -1.0)
    z = s * s
    w = z * z
    r = z * (_LG[0] + w * (_LG[2] + w * (_LG[4] + w * _LG[6]))) + w * (
        _LG[1] + w * (_LG[3] + w * _LG[5])
    )
    half_f_squared = 0.5 * f * f
    middle = dk * _LN2_HI - ((half_f_squared - (s * (half_f_squared + r) + dk * _LN2_LO)) - f)
    rest = dk * _LN2_HI - ((s * (f - r) - dk * _LN2_LO) - f)
    near_one = f * f * (0.5 - 0.33333333333333333 * f)
    tiny = dk * _LN2_HI - ((near_one - dk * _LN2_LO) - f)
    in_middle = tf.bitwise.bitwise_or(mantissa - 0x6147A, 0x6B851 - mantissa) > 0
    is_tiny = tf.bitwise.bitwise_and(mantissa + 2, 0x000FFFFF) < 3
    return tf.where(is_tiny, tiny, tf.where(in_middle, middle, rest))
