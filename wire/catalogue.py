"""The reductions pergrad computes, declared once: names, options and outputs.

Everything that speaks of a reduction derives from this table: the client builds requests,
checks and merges results with it; the server parses and validates options and prices
admission with it; the in-process engine validates its keywords with it; the CLI makes
its flags and output files from it; metrics take their label from it. Adding a reduction
is its enum value in gradient_service.proto, one `Reduction` here, and one engine module
(`pergrad/server/engine/reductions/<name>.py`). The proto's comments state the same rules
for readers of the wire contract; tests hold the two together.

No protobuf and no numpy arrays here: values are plain Python, checked by `Option.check`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

NONE = "none"


class OptionError(ValueError):
    """An option value the reduction cannot take; the message names the option."""


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
            return value
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


def _text(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


# Output shapes are tuples of tokens: "B" the batch, "var" the variable's shape, "K" the
# number of reference rows, or an option's name whose value is the size ("dim").
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

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
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
        return checked


LOSSES = Output(
    "losses", False, "example", ("B",), "each example's loss, with every reduction", "loss"
)

_NOISE_HELP = (
    "Gaussian noise of std noise_multiplier * max_norm added to every element of the sum"
)
DEFAULT_REDUCTIONS = (
    Reduction(
        NONE,
        0,
        "full per-example gradients",
        options=(
            Option(
                "wire_dtype",
                "choice",
                "element type of the gradients on the wire (default: each variable's own)",
                choices=("float32", "float64", "float16", "bfloat16"),
                enum_prefix="DATA_TYPE_",
            ),
        ),
        outputs=(
            Output(
                "gradients", True, "example", ("B", "var"), "g_b per variable", "grad", "grad"
            ),
        ),
    ),
    Reduction(
        "norms",
        1,
        "per-example L2 norms of the gradient, whole and per variable",
        outputs=(
            Output("norms", False, "example", ("B",), "||g_b|| over all selected variables"),
            Output("variable_norms", True, "example", ("B",), "||g_bv||", file_prefix="norm"),
        ),
    ),
    Reduction(
        "clipped_sum",
        2,
        "one DP-SGD step: the sum of per-example gradients clipped to max_norm, plus noise",
        options=(
            Option(
                "max_norm",
                "float",
                "clip each example's gradient to this L2 norm",
                required=True,
                minimum=0.0,
                exclusive_minimum=True,
                requirement="a finite positive bound",
            ),
            Option(
                "noise_multiplier",
                "float",
                _NOISE_HELP,
                default=0.0,
                minimum=0.0,
                once_per_batch=True,
            ),
            Option(
                "seed",
                "int",
                "noise seed (default: fresh noise from the OS's secure random source)",
                minimum=0,
                maximum=2**64 - 1,
            ),
        ),
        outputs=(
            Output("clipped_sum", True, "sum", ("var",), "sum_b min(1, C/||g_b||) g_bv + noise"),
            Output("norms", False, "example", ("B",), "||g_b|| before clipping"),
            Output("num_clipped", False, "count", (), "examples with ||g_b|| > C", "int64"),
        ),
    ),
    Reduction(
        "moments",
        3,
        "sums of g and of g^2 over the examples (diagonal Fisher, variance)",
        outputs=(
            Output("sum", True, "sum", ("var",), "sum_b g_bv"),
            Output("sum_squares", True, "sum", ("var",), "sum_b g_bv * g_bv, element-wise"),
        ),
    ),
    Reduction(
        "dot",
        4,
        "dot products with K reference gradients (TracIn)",
        options=(
            Option(
                "reference",
                "tensors",
                "one [K, *shape] array per selected variable",
                required=True,
            ),
        ),
        outputs=(Output("dots", False, "example", ("B", "K"), "sum_v <g_bv, reference_v[k]>"),),
    ),
    Reduction(
        "project",
        5,
        "seeded random projections of the gradients (TRAK-style features)",
        options=(
            Option(
                "dim",
                "int",
                "random features per example",
                required=True,
                minimum=1,
                maximum=1 << 16,
            ),
            Option("seed", "int", "projection seed", default=0, minimum=0, maximum=2**64 - 1),
            Option(
                "kind",
                "choice",
                "distribution of the projection's entries",
                wire_field="projection",
                default="rademacher",
                choices=("rademacher", "gaussian"),
                enum_prefix="PROJECTION_KIND_",
            ),
        ),
        outputs=(Output("projections", False, "example", ("B", "dim"), "R g_b / sqrt(dim)"),),
    ),
)


@dataclass
class Catalogue:
    """The reductions by name; `extended` adds one for a block (tests)."""

    reductions: dict[str, Reduction] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reductions = dict(self.reductions)

    @property
    def names(self) -> list[str]:
        return list(self.reductions)

    def get(self, name: str) -> Reduction:
        try:
            return self.reductions[str(name).lower()]
        except KeyError:
            known = ", ".join(self.reductions)
            raise OptionError(f"reduction: unknown {name!r}; known: {known}") from None

    def check_options(self, reduction: Reduction, options: Mapping[str, Any]) -> dict[str, Any]:
        """`reduction.check_options`; an option of other reductions is named as theirs."""
        try:
            return reduction.check_options(options)
        except OptionError as err:
            owners = {
                name: [r.name for r in self.reductions.values() if name in r.option_names]
                for name in sorted(set(options) - set(reduction.option_names))
            }
            hints = [f"{name} applies to {', '.join(o)}" for name, o in owners.items() if o]
            raise OptionError("; ".join([str(err), *hints])) from None

    def by_number(self, number: int) -> Reduction:
        for reduction in self.reductions.values():
            if reduction.number == number:
                return reduction
        known = ", ".join(f"{r.number} ({r.name})" for r in self.reductions.values())
        raise OptionError(f"reduction: unknown value {number}; known: {known}")

    def output(self, field_name: str) -> Output:
        """The output named `field_name` (the same name means the same thing everywhere)."""
        for output in self.outputs():
            if output.field == field_name:
                return output
        raise KeyError(field_name)

    def outputs(self) -> Iterator[Output]:
        """Every distinct output field, `losses` first, in declaration order."""
        seen = {LOSSES.field}
        yield LOSSES
        for reduction in self.reductions.values():
            for output in reduction.outputs:
                if output.field not in seen:
                    seen.add(output.field)
                    yield output

    def options(self) -> Iterator[Option]:
        """Every distinct option, in declaration order (options of one name agree)."""
        seen: set[str] = set()
        for reduction in self.reductions.values():
            for option in reduction.options:
                if option.name not in seen:
                    seen.add(option.name)
                    yield option

    @contextmanager
    def extended(self, reduction: Reduction) -> Iterator[Reduction]:
        self.reductions[reduction.name] = reduction
        try:
            yield reduction
        finally:
            del self.reductions[reduction.name]


CATALOGUE = Catalogue({r.name: r for r in DEFAULT_REDUCTIONS})
