"""One casting policy for what users hand in: the client, the CLI and the in-process engine
all cast inputs, labels and references with `cast`.

numpy's defaults are float64 and int64; models take float32 and int32. A value is cast to
the dtype the model expects when nothing is lost: float64 -> float32 for finite values
within float32's range, int64 -> int32 for values that fit, integers and booleans ->
floats, any memory layout (the result is C-contiguous). Casts that change a value's kind
in a lossy way (floats to integers) or its value (out of range) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike


class CastError(ValueError):
    """An array that cannot become the dtype the model expects without losing values."""


def dtype_named(name: str) -> np.dtype:
    """numpy's dtype of a name: "float32", ..., "bfloat16" too. ml_dtypes, which takes
    about a second to import, loads only when bfloat16 is asked for (an array of it
    has loaded it already), so a client that never uses it starts without it."""
    if name != "bfloat16":
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def cast(array: Any, dtype: DTypeLike, *, what: str) -> np.ndarray:
    """`array` as a C-contiguous array of `dtype`; CastError names `what` otherwise."""
    array, dtype = np.asarray(array), np.dtype(dtype)
    if array.dtype == dtype:
        return np.asarray(array, order="C")
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise CastError(f"{what}: model expects {dtype.name}, got {array.dtype.name}")
    if array.size and array.dtype.kind in "iu" and dtype.kind in "iu":
        limits = np.iinfo(dtype)
        if array.min() < limits.min or array.max() > limits.max:
            raise CastError(f"{what}: values outside the range of {dtype.name}")
    out = np.asarray(array, dtype=dtype, order="C")
    if array.size and dtype.kind == "f" and array.dtype.kind == "f":
        overflowed = np.isinf(out) & np.isfinite(array)
        if overflowed.any():
            raise CastError(f"{what}: values outside the range of {dtype.name}")
    return out


def arrays_by_input(x: Any, names: Sequence[str]) -> list[Any]:
    """`x` as one value per model input, in the order of `names`: an array for a model of
    one input, a mapping by input name, or a list in model order."""
    names = list(names)
    if isinstance(x, Mapping):
        missing, unknown = sorted(set(names) - set(x)), sorted(set(x) - set(names))
        if missing or unknown:
            raise CastError(
                f"inputs: the model's inputs are {names}; missing {missing}, unknown {unknown}"
            )
        return [x[name] for name in names]
    if isinstance(x, list | tuple) and len(names) > 1:
        if len(x) != len(names):
            raise CastError(f"inputs: {len(x)} arrays for the model's inputs {names}")
        return list(x)
    if len(names) > 1:
        raise CastError(
            f"inputs: the model has inputs {names}; pass a mapping from these names to arrays"
        )
    return [x]


def rows(x: Any, part: slice) -> Any:
    """Examples `part` of inputs given as an array, a mapping or a list of arrays."""
    if isinstance(x, Mapping):
        return {name: value[part] for name, value in x.items()}
    if isinstance(x, list | tuple):
        return [value[part] for value in x]
    return x[part]
