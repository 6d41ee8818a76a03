"""The terms a reduction is declared in: its options (`Option`, checked by `Option.check`),
its outputs (`Output`) and the `Reduction` that holds them. The entries themselves, and
the `Catalogue` of them everyone imports, are in `pergrad.wire.catalogue`, which
re-exports these.

Plain Python: no protobuf and no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pergrad.wire.casting import CastError, cast


class OptionError(ValueError):
    """An option value the reduction cannot take; the message names the option."""


class CheckedOptions(dict):
    """A reduction's options checked by `Reduction.check_options`, defaults filled in:
    what every stage after the edge that received them takes without checking again."""

    def __init__(self, reduction: str, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.reduction = reduction


@dataclass(frozen=True)
class Option:
    """One keyword of a reduction, and the GradientsRequest field that carries it.

    kind: "float", "int", "choice" (one of `choices`, an enum on the wire whose value
    names are `enum_prefix` + the choice in capitals) or "tensors" (one array per
    selected variable, a map of Tensors on the wire).
    """

    name: str
    kind: Literal["float", "int", "choice", "tensors"]
    help: str
    wire_field: str = ""  # defaults to `name`
    required: bool = False
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    enum_prefix: str = ""
    # When a batch is split into micro-batches, only the first keeps this option's value;
    # the others take `default` (noise is added to a batch once).
    once_per_batch: bool = False
    # What a valid value is, in words (default: from kind, range and choices).
    requirement: str = ""

    @property
    def field(self) -> str:
        return self.wire_field or self.name

    @property
    def needs(self) -> str:
        if self.requirement:
            return self.requirement
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "tensors":
            return self.help
        low, high, name = self.minimum, self.maximum, self.name
        low_text = ""
        if low is not None:
            low_text = f"{_text(low)} {'<' if self.exclusive_minimum else '<='} "
        if high is not None:
            high_text = f" <= {_text(high)}"
        else:
            high_text = " < inf" if self.kind == "float" else ""
        return f"{low_text}{name}{high_text}"

    def check(self, value: Any, reduction: str) -> Any:
        """`value` as this option holds it, or OptionError naming the option and the rule."""
        if self.kind == "choice":
            text = str(value).lower()
            if text not in self.choices:
                known = ", ".join(self.choices)
                raise OptionError(f"{self.name}: unknown {self.name} {value!r}; known: {known}")
            return text
        if self.kind == "tensors":
            if not isinstance(value, Mapping):
                raise OptionError(f"{self.name}: {reduction} needs {self.needs}")
            return {
                name: _finite_float32(array, f"{self.field}[{name!r}]")
                for name, array in value.items()
            }
        number = self._number(value, reduction)
        low, high = self.minimum, self.maximum
        below = low is not None and (number <= low if self.exclusive_minimum else number < low)
        if not math.isfinite(number) or below or (high is not None and number > high):
            raise OptionError(f"{self.name}: {reduction} needs {self.needs}, got {value!r}")
        return number

    def _number(self, value: Any, reduction: str) -> float | int:
        try:
            if isinstance(value, bool | str | bytes):
                raise TypeError
            if self.kind == "int":
                if int(value) != value:
                    raise ValueError
                return int(value)
            return float(value)
        except (TypeError, ValueError, OverflowError):
            raise OptionError(
                f"{self.name}: {reduction} needs {self.needs}, got {value!r}"
            ) from None


def _finite_float32(value: Any, what: str) -> np.ndarray:
    """A tensors option's array, checked as inputs are: float32 (cast from another float
    type within its range, or from an integer type), of rank >= 1, every value finite."""
    try:
        array = cast(value, np.float32, what=what)
    except CastError as err:
        raise OptionError(str(err)) from None
    if array.ndim == 0:
        raise OptionError(f"{what}: a [K, *shape] tensor, got a scalar")
    if not np.isfinite(array).all():
        raise OptionError(f"{what}: holds NaN or infinity")
    return array


def _text(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


# Output shapes are tuples of tokens: "B" the batch, "var" the variable's shape, "K" the
# leading size of the arrays of the reduction's "tensors" option (dot's `reference` rows),
# or an option's name whose value is the size ("dim").
# dtype tokens: "loss" the model's output dtype, "grad" the variable's (or wire) dtype.
Rows = Literal["example", "sum", "count"]


@dataclass(frozen=True)
class Output:
    """One tensor (or one per selected variable) a reduction returns.

    rows: "example" one row per example (micro-batches concatenate), "sum" summed over
    the examples (micro-batches add), "count" an integer count (micro-batches add).
    """

    field: str
    per_variable: bool
    rows: Rows
    shape: tuple[str, ...]
    help: str
    dtype: str = "float32"
    file_prefix: str = ""  # the name `pergrad grads` gives it in its .npz (default: field)

    @property
    def prefix(self) -> str:
        return self.file_prefix or self.field


@dataclass(frozen=True)
class Reduction:
    name: str
    number: int  # its value in the proto's Reduction enum (REDUCTION_<NAME in capitals>)
    help: str
    options: tuple[Option, ...] = ()
    outputs: tuple[Output, ...] = ()

    @property
    def option_names(self) -> list[str]:
        return [o.name for o in self.options]

    def check_options(self, options: Mapping[str, Any]) -> CheckedOptions:
        """Every option checked, defaults filled in; OptionError names the first fault.
        (`Catalogue.check_options` also says which reductions take an unknown option.)"""
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            takes = sorted(self.option_names)
            raise OptionError(
                f"{unknown}: not options of reduction {self.name!r}, which takes {takes}"
            )
        checked = {}
        for option in self.options:
            value = options.get(option.name)
            if value is None:
                if option.required:
                    raise OptionError(f"{option.name}: {self.name} needs {option.needs}")
                checked[option.name] = option.default
            else:
                checked[option.name] = option.check(value, self.name)
        return CheckedOptions(self.name, checked)
