"""cos and sin of Box-Muller's angles, against the truth computed in decimal."""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np
import pytest

from pergrad.server.engine.reductions import sincos


def _true_cos_sin(angle: float) -> tuple[Decimal, Decimal]:
    """cos and sin of the float `angle` exactly as given, to 60 digits: Taylor's series
    of the whole angle, which at |angle| <= 2 pi needs no reduction at this precision."""
    with localcontext() as context:
        context.prec = 60
        x, cos, sin, term, n = Decimal(angle), Decimal(0), Decimal(0), Decimal(1), 0
        while n < 10 or abs(term) > Decimal(10) ** -60:
            cos, sin, n = cos + term, sin + term * x / (n + 1), n + 2
            term = -term * x * x / (n * (n - 1))
        return cos, sin


def _ulps(made: float, truth: Decimal) -> float:
    return float(abs(Decimal(made) - truth) / Decimal(np.spacing(abs(float(truth)))))


def _angles(words: np.ndarray) -> np.ndarray:
    """Box-Muller's angles: (lo + 0.5) * 2^-32 * (2 pi) for 32-bit words lo."""
    return (words.astype(np.float64) + 0.5) * 2.0**-32 * (2.0 * np.pi)


def _random_angles(count: int) -> np.ndarray:
    return _angles(np.random.default_rng(5).integers(0, 2**32, count, dtype=np.uint64))


WORST_WORD = 2145355171  # t = 3.138478866836648


def _hard_angles() -> np.ndarray:
    """The angles nearest the ends, the nodes and the points between them, and the zeros
    of cos and sin, where a sum of table values nearly cancels; and the worst of all 2^32
    (2.18 ulps: sin near node 511, measured against 80-bit long double)."""
    turns = np.arange(2 * sincos.NODES + 1) / (2 * sincos.NODES)  # nodes and midpoints
    nearest = np.floor(turns * 2.0**32).astype(np.int64)
    worst = np.array([WORST_WORD])
    words = np.concatenate([nearest + k for k in (-2, -1, 0, 1)] + [worst - 1, worst, worst + 1])
    return _angles(words[(words >= 0) & (words < 2**32)].astype(np.uint64))


@pytest.mark.parametrize("angles", [_random_angles(3000), _hard_angles()], ids=["random", "hard"])
def test_cos_and_sin_are_within_2_2_ulps_of_the_truth(angles: np.ndarray) -> None:
    cos, sin = (t.numpy() for t in sincos.cos_sin(angles))
    worst = 0.0
    for angle, c, s in zip(angles, cos, sin, strict=True):
        true_cos, true_sin = _true_cos_sin(float(angle))
        worst = max(worst, _ulps(float(c), true_cos), _ulps(float(s), true_sin))
    assert worst <= 2.2


def test_nearly_every_result_is_libms_to_the_bit() -> None:
    angles = _random_angles(200_000)
    cos, sin = (t.numpy() for t in sincos.cos_sin(angles))
    # Measured: 0.5% differ by an ulp from glibc's (itself within 0.52 ulp of the truth).
    assert np.mean(cos != np.cos(angles)) < 0.02
    assert np.mean(sin != np.sin(angles)) < 0.02


def test_fresh_noises_finer_angles_are_within_2_ulps_of_1_of_the_truth() -> None:
    """Fresh noise's angles are b 2^-53 turns for 53-bit b: any may lie near a zero of cos
    or sin, where only absolute error is meaningful (it is what the Gaussian entry gets)."""
    b = np.random.default_rng(8).integers(0, 2**53, 3000, dtype=np.uint64)
    turns = np.concatenate([b, np.array([0, 2**51, 2**52, 3 * 2**51, 2**53 - 1], np.uint64)])
    angles = turns.astype(np.float64) * 2.0**-53 * (2.0 * np.pi)
    cos, sin = (t.numpy() for t in sincos.cos_sin(angles))
    for angle, c, s in zip(angles, cos, sin, strict=True):
        true_cos, true_sin = _true_cos_sin(float(angle))
        assert abs(Decimal(float(c)) - true_cos) <= Decimal(2.0**-52)
        assert abs(Decimal(float(s)) - true_sin) <= Decimal(2.0**-52)
