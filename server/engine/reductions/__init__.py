"""Server-side reductions of per-example gradients: each answers without B x P on the wire.

A reduction sees the selected variables' per-example gradients slice by slice
(`add`, factored where a rule allows) and returns its output fields (`finish`), as
`pergrad.wire.catalogue` declares them; its options arrive checked by the catalogue.

    norms        norms [B], variable_norms {name: [B]}
    clipped_sum  clipped_sum {name: var-shaped}, norms [B], num_clipped  (DP-SGD step)
    moments      sum, sum_squares {name: var-shaped}                     (diagonal Fisher)
    dot          dots [B, K] against K reference gradients               (TracIn)
    project      projections [B, dim], a seeded random projection        (TRAK)

Each lives in the module named after it, whose `REDUCTION` is the class:
`default_reductions()` registers every such module of this package, and an `Engine`
takes that registry or another (`Engine(reductions=...)`), as it takes its layer rules.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.slices import VariableSpec


class Reduction(Protocol):
    def add(self, grads: Mapping[str, Grad]) -> None: ...

    def finish(self) -> dict[str, Any]: ...


class InPassReduction(Reduction, Protocol):
    """A reduction the pass computes itself from the factors (`in_pass`): its squared
    norms, and its clipped sums under `max_norm` where IN_PASS_CLIP."""

    IN_PASS_CLIP: bool
    max_norm: float

    def add_in_pass(
        self, squares: Mapping[str, np.ndarray], sums: Mapping[str, np.ndarray]
    ) -> None: ...


def in_pass(reduction: Reduction) -> InPassReduction | None:
    """The reduction, if the pass can compute it itself (its class defines
    `add_in_pass`). Not `isinstance` on a runtime-checkable Protocol, which walks the
    Protocol's members on every call: 0.06 ms of a 0.8 ms B=8 norms call."""
    return cast(InPassReduction, reduction) if hasattr(type(reduction), "add_in_pass") else None


def summed(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """The sum of one array or more, as `sum` would give it (whose start, 0, types it as
    possibly an int)."""
    return functools.reduce(np.add, arrays)


Maker = Callable[..., Reduction]


class ReductionRegistry:
    """Reduction name (as the catalogue names it) -> the class that computes it."""

    def __init__(self, makers: Mapping[str, Maker] | None = None) -> None:
        self._makers = dict(makers or {})

    def register(self, name: str, maker: Maker) -> None:
        self._makers[name] = maker

    def names(self) -> list[str]:
        return sorted(self._makers)

    def make(
        self, name: str, variables: Sequence[VariableSpec], options: Mapping[str, Any]
    ) -> Reduction:
        """A reduction over `variables` with `options` the catalogue checked."""
        if name not in self._makers:
            raise KeyError(f"no engine class for reduction {name!r}; known: {self.names()}")
        return self._makers[name](variables, **options)


def default_reductions() -> ReductionRegistry:
    """Every module of this package that declares a `REDUCTION`, under its module name."""
    registry = ReductionRegistry()
    for module in pkgutil.iter_modules(__path__):
        maker = getattr(importlib.import_module(f"{__name__}.{module.name}"), "REDUCTION", None)
        if maker is not None:
            registry.register(module.name, maker)
    return registry
