"""One casting policy for what users hand in: the client, the CLI and the in-process engine
all cast inputs, labels and references with `cast`.

numpy's defaults are float64 and int64; models take float32 and int32. A value is cast to
the dtype the model expects when nothing is lost: float64 -> float32 for finite values
within float32's range, int64 -> int32 for values that fit, integers and booleans ->
floats, any memory layout (the result is C-contiguous). Casts that change a value's kind
in a lossy way (floats to integers) or its value (out of range) are refused.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


class CastError(ValueError):
    """An array that cannot become the dtype the model expects without losing values."""


def dtype_named(name: str) -> np.dtype:
    """numpy's dtype of a name: "float32", ..., "bfloat16" (ml_dtypes) too."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cast(array: Any, dtype: np.dtype | str, *, what: str) -> np.ndarray:
    """`array` as a C-contiguous array of `dtype`; CastError names `what` otherwise."""
    array, dtype = np.asarray(array), np.dtype(dtype)
    if array.dtype == dtype:
        return np.ascontiguousarray(array)
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise CastError(f"{what}: model expects {dtype.name}, got {array.dtype.name}")
    if array.size and array.dtype.kind in "iu" and dtype.kind in "iu":
        limits = np.iinfo(dtype)
        if array.min() < limits.min or array.max() > limits.max:
            raise CastError(f"{what}: values outside the range of {dtype.name}")
    out = np.ascontiguousarray(array, dtype=dtype)
    if array.size and dtype.kind == "f" and array.dtype.kind == "f":
        overflowed = np.isinf(out) & np.isfinite(array)
        if overflowed.any():
            raise CastError(f"{what}: values outside the range of {dtype.name}")
    return out
