"""The reductions pergrad computes, declared once: names, options and outputs.

Everything that speaks of a reduction derives from this table: the client builds requests,
checks and merges results with it; the server parses and validates options and prices
admission with it; the in-process engine validates its keywords with it; the CLI makes
its flags and output files from it; metrics take their label from it. Adding a reduction
is its enum value in gradient_service.proto, one `Reduction` here, and one engine module
(`pergrad/server/engine/reductions/<name>.py`). The proto's comments state the same rules
for readers of the wire contract; tests hold the two together.

The terms the entries are written in (`Option`, `Output`, `Reduction`, `OptionError`)
are defined in `pergrad.wire.terms` and re-exported here: import them from this module.
No protobuf here: values are plain Python (a tensors option's, float32 numpy arrays),
checked by `Option.check`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pergrad.wire.terms import CheckedOptions, Option, OptionError, Output, Reduction, Rows

__all__ = [
    "CATALOGUE",
    "DEFAULT_REDUCTIONS",
    "LOSSES",
    "NONE",
    "Catalogue",
    "CheckedOptions",
    "Option",
    "OptionError",
    "Output",
    "Reduction",
    "Rows",
]

NONE = "none"


LOSSES = Output(
    "losses", False, "example", ("B",), "each example's loss, with every reduction", "loss"
)

_NOISE_HELP = "Gaussian noise of std noise_multiplier * max_norm added to every element of the sum"
# One declaration for the reductions that draw random numbers (the proto's "Random numbers").
SEED = Option(
    "seed",
    "int",
    "seed of the reduction's random numbers; unset: clipped_sum's noise is fresh from the "
    "OS's secure source, project's matrix is seed 0's",
    minimum=0,
    maximum=2**64 - 1,
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
            Output("gradients", True, "example", ("B", "var"), "g_b per variable", "grad", "grad"),
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
            SEED,
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
            SEED,
            Option(
                "projection",
                "choice",
                "distribution of the projection's entries",
                default="rademacher",
                choices=("rademacher", "gaussian"),
                enum_prefix="PROJECTION_KIND_",
            ),
        ),
        outputs=(Output("projections", False, "example", ("B", "dim"), "R g_b / sqrt(dim)"),),
    ),
)


# The client's call parameters (`GradientClient.per_example_gradients` and `stream`, whose
# other keywords are reduction options): no option may take one of these names, or the
# call would swallow it (tests/client/test_call.py holds the client's signatures to it).
# The reductions a training step (ApplyStep) applies, each with the output that is its
# gradient sum: DP-SGD's noised clipped sum, or the plain sum.
STEP_SUMS = {"clipped_sum": "clipped_sum", "moments": "sum"}

CALL_PARAMETERS = frozenset(
    {"model", "x", "y", "batches", "out", "timeout", "reduction", "variables"}
    | {"model_version", "weights_id", "upcast"}
)


def _free_names(reduction: Reduction) -> Reduction:
    taken = sorted(set(reduction.option_names) & CALL_PARAMETERS)
    if taken:
        raise ValueError(f"{reduction.name}: options {taken} would be call parameters")
    return reduction


@dataclass
class Catalogue:
    """The reductions by name; `extended` adds one for a block (tests). An option named
    like a call parameter is refused here (CALL_PARAMETERS)."""

    reductions: dict[str, Reduction] = field(default_factory=dict)
    _by_field: dict[str, Output] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.reductions = {name: _free_names(r) for name, r in self.reductions.items()}
        self._index()

    def _index(self) -> None:
        """`output`'s table, made again whenever the reductions change: a result reads
        each of its outputs through it (`outputs` scanned on each read took 3.6-3.8 us a
        read here, the table 1.3-2.1)."""
        self._by_field = {output.field: output for output in self.outputs()}

    @property
    def names(self) -> list[str]:
        return list(self.reductions)

    def get(self, name: str) -> Reduction:
        try:
            return self.reductions[str(name).lower()]
        except KeyError:
            known = ", ".join(self.reductions)
            raise OptionError(f"reduction: unknown {name!r}; known: {known}") from None

    def check_options(self, reduction: Reduction, options: Mapping[str, Any]) -> CheckedOptions:
        """`reduction.check_options`; an option of other reductions is named as theirs.
        Options this reduction checked already pass as they are."""
        if isinstance(options, CheckedOptions) and options.reduction == reduction.name:
            return options
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
        return self._by_field[field_name]

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
        self.reductions[reduction.name] = _free_names(reduction)
        self._index()
        try:
            yield reduction
        finally:
            del self.reductions[reduction.name]
            self._index()


CATALOGUE = Catalogue({r.name: r for r in DEFAULT_REDUCTIONS})
