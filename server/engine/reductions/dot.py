"""DOT: <g_b, r_k> for each example b and each of K reference gradients (TracIn,
influence with a preconditioned reference). For flat Dense inputs: a_b^T R_k g_b."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions import summed
from pergrad.server.engine.reductions.factored import dots
from pergrad.server.engine.slices import VariableSpec
from pergrad.server.errors import InvalidArgument


def _checked(
    variables: Sequence[VariableSpec], reference: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """One [K, *shape] array per selected variable, the same K >= 1 for all (each array
    cast to float32 and checked finite by the catalogue, at the edge it arrived at)."""
    reference = dict(reference)
    names = {v.name for v in variables}
    if reference.keys() != names:
        missing, extra = sorted(names - reference.keys()), sorted(reference.keys() - names)
        raise InvalidArgument(
            f"reference: needs one [K, *shape] tensor per selected variable; "
            f"missing {missing}, unknown {extra}"
        )
    counts = {np.shape(r)[0] if np.ndim(r) else 0 for r in reference.values()}
    if len(counts) != 1 or 0 in counts:
        raise InvalidArgument(f"reference: every tensor needs the same K >= 1, got {counts}")
    for v in variables:
        got = tuple(np.shape(reference[v.name])[1:])
        if got != v.shape:
            raise InvalidArgument(
                f"reference[{v.name!r}]: shape [K, {', '.join(map(str, got))}], "
                f"variable is {list(v.shape)}"
            )
    return {v.name: reference[v.name] for v in variables}


class Dot:
    def __init__(
        self, variables: Sequence[VariableSpec], *, reference: Mapping[str, np.ndarray]
    ) -> None:
        self._variables = variables
        self._reference = _checked(variables, reference)
        self._parts: list[np.ndarray] = []

    def add(self, grads: Mapping[str, Grad]) -> None:
        self._parts.append(
            summed(dots(grads[v.name], self._reference[v.name], v.dtype) for v in self._variables)
        )

    def finish(self) -> dict[str, Any]:
        return {"dots": np.concatenate(self._parts).astype(np.float32)}


REDUCTION = Dot
