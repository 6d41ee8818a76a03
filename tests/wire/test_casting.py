"""wire.casting.cast: numpy's defaults become the model's dtypes when no value changes,
and every cast that would change a value is refused, at both ends of a range."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pergrad.wire.casting import CastError, cast


@pytest.mark.parametrize(
    ("values", "source", "target"),
    [
        ([1.5, -2.25], np.float64, np.float32),
        ([0, 7, -3], np.int64, np.int32),
        ([0, 255], np.uint8, np.int32),
        ([True, False], np.bool_, np.float32),
        ([3, -4], np.int64, np.float32),
        ([1.0, 2.0], np.float32, ml_dtypes.bfloat16),
    ],
)
def test_lossless_casts_keep_every_value(values, source, target) -> None:
    array = np.array(values, dtype=source)
    out = cast(array, target, what="inputs")
    assert out.dtype == np.dtype(target)
    np.testing.assert_array_equal(out.astype(np.float64), array.astype(np.float64))


@pytest.mark.parametrize(
    "value",
    [np.iinfo(np.int32).min - 1, np.iinfo(np.int32).max + 1, np.iinfo(np.int64).min],
)
def test_int64_outside_int32_is_refused_at_either_end(value: int) -> None:
    array = np.array([0, value], dtype=np.int64)
    with pytest.raises(CastError, match="labels: values outside the range of int32"):
        cast(array, np.int32, what="labels")


def test_int32_limits_themselves_are_kept() -> None:
    limits = np.iinfo(np.int32)
    array = np.array([limits.min, limits.max], dtype=np.int64)
    np.testing.assert_array_equal(cast(array, np.int32, what="labels"), array)


@pytest.mark.parametrize("value", [1e39, -1e39])
def test_float64_beyond_float32_is_refused(value: float) -> None:
    with pytest.raises(CastError, match="inputs: values outside the range of float32"):
        cast(np.array([0.0, value]), np.float32, what="inputs")


def test_infinity_stays_infinity_for_the_batch_check_to_name() -> None:
    """An infinite input is not a range error of the cast: the server's batch check
    refuses non-finite inputs naming the examples."""
    out = cast(np.array([np.inf, 1.0]), np.float32, what="inputs")
    assert np.isinf(out[0])


def test_floats_to_integers_are_refused() -> None:
    with pytest.raises(CastError, match="labels: model expects int32, got float64"):
        cast(np.array([1.0, 2.0]), np.int32, what="labels")


def test_any_memory_layout_comes_back_c_contiguous() -> None:
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    out = cast(strided, np.float32, what="inputs")
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, strided)


def test_a_scalar_stays_a_scalar() -> None:
    """Its shape is checked after the cast (a DOT reference must have a K axis)."""
    assert cast(np.float64(2.5), np.float32, what="reference").shape == ()
    assert cast(np.float32(2.5), np.float32, what="reference").shape == ()
