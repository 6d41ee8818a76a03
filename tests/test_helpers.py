"""The tests' own comparison: what it calls close (every result test leans on it)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import assert_close


def test_a_nan_is_never_close() -> None:
    """NaN compares false with any bound: a result of NaN must not pass for the reference."""
    with pytest.raises(AssertionError, match="w: relative error nan"):
        assert_close({"w": np.array([1.0, np.nan])}, {"w": np.array([1.0, 2.0])})


def test_errors_within_the_bound_pass_and_beyond_it_fail() -> None:
    assert_close({"w": np.array([1.0, 2.0 + 1e-6])}, {"w": np.array([1.0, 2.0])})
    with pytest.raises(AssertionError, match="w: relative error"):
        assert_close({"w": np.array([1.0, 2.1])}, {"w": np.array([1.0, 2.0])})
