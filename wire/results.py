"""A batch's results in numpy terms, by the catalogue: `GradientResult`, the outputs a
request implies (names, shapes), and one result from the results of its micro-batches.

numpy only: the in-process engine returns these, the client receives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from pergrad.wire.casting import dtype_named
from pergrad.wire.catalogue import CATALOGUE, LOSSES, Catalogue, Output, Reduction


class GradientResult:
    """Per-example results of one batch; which outputs are set depends on the reduction.

    Attributes:
        losses: per-example loss, [B] (always).
        model_version, weights_id: the version and the identity (a digest of the content)
            of the weights every tensor was computed with.
        model: the model's name. server: the replica(s) that computed it; plan_id their
            plans' fingerprints (ModelInfo.plan_id), comma-separated where they differ.
        outputs: {field: value} of the reduction's outputs; each is also an attribute.
            Per-variable fields map variable names to arrays ({} when the reduction has
            none), counts are ints, other fields arrays (None when absent):
            gradients {var: [B, *shape]} ("none"); norms [B] and variable_norms {var: [B]}
            ("norms", norms also "clipped_sum"); clipped_sum {var: shape} and num_clipped
            ("clipped_sum"); sum and sum_squares {var: shape} ("moments"); dots [B, K]
            ("dot"); projections [B, dim] ("project"). `pergrad.wire.catalogue` and the
            proto's Reduction comment define each.
    """

    def __init__(
        self,
        losses: np.ndarray,
        *,
        model_version: int = 0,
        weights_id: str = "",
        model: str = "",
        server: str = "",
        plan_id: str = "",
        catalogue: Catalogue = CATALOGUE,
        **outputs: Any,
    ) -> None:
        self.__dict__.update(
            losses=losses,
            model_version=model_version,
            weights_id=weights_id,
            model=model,
            server=server,
            plan_id=plan_id,
            outputs={},
            _catalogue=catalogue,
        )
        for name, value in outputs.items():
            setattr(self, name, value)

    def _output(self, name: str) -> Output:
        if name.startswith("_") or name == LOSSES.field:
            raise AttributeError(name)
        try:
            return self.__dict__["_catalogue"].output(name)
        except KeyError:
            raise AttributeError(f"GradientResult has no output {name!r}") from None

    def __getattr__(self, name: str) -> Any:
        output = self._output(name)
        return self.__dict__["outputs"].get(name, {} if output.per_variable else None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
            return
        self._output(name)
        self.__dict__["outputs"][name] = value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(o.field for o in self._catalogue.outputs())})

    def __repr__(self) -> str:
        fields = ", ".join(self.outputs)
        return f"GradientResult(model={self.model!r}, batch_size={self.batch_size}, {fields})"

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def gradient_norms(self) -> np.ndarray:
        """Per-example L2 norms computed here from the full `gradients`, [B]."""
        squares = np.zeros(self.batch_size, dtype=np.float64)
        for grad in self.gradients.values():
            flat = grad.reshape(self.batch_size, -1).astype(np.float64, copy=False)
            squares += np.einsum("bp,bp->b", flat, flat)
        return np.sqrt(squares)


@dataclass(frozen=True)
class ExpectedOutput:
    """One tensor a request's result holds: its field, variable ("" if none), shape and
    dtype token ("loss", "grad" or a numpy dtype name; see `Output`)."""

    output: Output
    variable: str
    shape: tuple[int, ...]

    @property
    def field(self) -> str:
        return self.output.field

    @overload
    def dtype(
        self, variables: Mapping[str, np.dtype], wire: str | None, loss: np.dtype
    ) -> np.dtype: ...

    @overload
    def dtype(
        self, variables: Mapping[str, np.dtype], wire: str | None, loss: None
    ) -> np.dtype | None: ...

    def dtype(
        self, variables: Mapping[str, np.dtype], wire: str | None, loss: np.dtype | None
    ) -> np.dtype | None:
        """Its dtype: the losses' is the model's (`loss`: None where unknown, as to a
        client), a gradient's the wire's asked for or else its variable's, any other its
        token's."""
        token = self.output.dtype
        if token == "loss":
            return loss
        if token == "grad":
            return dtype_named(wire) if wire else variables[self.variable]
        return np.dtype(token)


def expected_outputs(
    reduction: Reduction,
    *,
    batch: int,
    variables: Sequence[tuple[str, tuple[int, ...]]],
    options: Mapping[str, Any],
) -> list[ExpectedOutput]:
    """Every tensor the result of `reduction` over `variables` (name, shape) holds, in the
    order a result lists them: losses, then each output, per variable in model order."""
    expected = []
    for output in (LOSSES, *reduction.outputs):
        targets = variables if output.per_variable else [("", ())]
        for name, shape in targets:
            dims = [_size(token, batch, shape, options, reduction) for token in output.shape]
            expected.append(ExpectedOutput(output, name, tuple(d for dim in dims for d in dim)))
    return expected


def _size(
    token: str,
    batch: int,
    shape: tuple[int, ...],
    options: Mapping[str, Any],
    reduction: Reduction,
) -> tuple[int, ...]:
    if token == "B":
        return (batch,)
    if token == "var":
        return tuple(shape)
    if token == "K":
        arrays = [
            array
            for option in reduction.options
            if option.kind == "tensors"
            for array in (options.get(option.name) or {}).values()
        ]
        return (int(np.shape(arrays[0])[0]) if arrays else 0,)
    return (int(options[token]),)


def merge(parts: Sequence[GradientResult], *, into: GradientResult | None = None) -> GradientResult:
    """The result of a batch from its micro-batches' results, in order: per-example rows
    concatenated, sums and counts added (`Output.rows`); copied into `into`'s arrays
    (a result of the same call shape) if given."""
    first = parts[0]
    outputs: dict[str, Any] = {}
    for field, value in first.outputs.items():
        output = first._catalogue.output(field)
        values = [p.outputs[field] for p in parts]
        if output.per_variable:
            outputs[field] = {k: _combine(output, [v[k] for v in values]) for k in value}
        else:
            outputs[field] = _combine(output, values)
    return _assembled(parts, np.concatenate([p.losses for p in parts]), outputs, into)


def side_by_side(
    parts: Sequence[GradientResult], *, into: GradientResult | None = None
) -> GradientResult:
    """The result of a batch from its results on parts of an option's rows (a `dot`'s
    reference rows, "K"): outputs with a "K" dimension joined along it, in order; the
    others, the batch's own (losses), from the first part."""
    first = parts[0]
    outputs = dict(first.outputs)
    for field in first.outputs:
        shape = first._catalogue.output(field).shape
        if "K" in shape:
            outputs[field] = np.concatenate(
                [p.outputs[field] for p in parts], axis=shape.index("K")
            )
    return _assembled(parts, first.losses, outputs, into)


def _assembled(
    parts: Sequence[GradientResult],
    losses: np.ndarray,
    outputs: dict[str, Any],
    into: GradientResult | None,
) -> GradientResult:
    """A result of these losses and outputs, made from `parts` (the first's weights and
    model, every part's server and plan, each named once), copied into `into` if given."""
    first = parts[0]
    result = GradientResult(
        losses,
        model_version=first.model_version,
        weights_id=first.weights_id,
        model=first.model,
        server=",".join(dict.fromkeys(p.server for p in parts)),
        plan_id=",".join(dict.fromkeys(p.plan_id for p in parts)),
        catalogue=first._catalogue,
        **outputs,
    )
    return result if into is None else _refilled(into, result)


def _refilled(into: GradientResult, result: GradientResult) -> GradientResult:
    """`into` holding `result`'s values, in its own arrays; ValueError, before anything is
    copied, unless every array has its counterpart's shape and dtype."""
    pairs = [(into.losses, result.losses, "losses")]
    for field, value in result.outputs.items():
        held = into.outputs.get(field)
        if isinstance(value, Mapping):
            held = held if isinstance(held, Mapping) else {}
            pairs += [(held.get(name), array, f"{field} {name!r}") for name, array in value.items()]
        elif isinstance(value, np.ndarray):
            pairs.append((held, value, field))
    for held, value, what in pairs:
        if not isinstance(held, np.ndarray) or (held.shape, held.dtype) != (
            value.shape,
            value.dtype,
        ):
            got = f"{held.dtype} {list(held.shape)}" if isinstance(held, np.ndarray) else "none"
            raise ValueError(
                f"out= holds {got} for {what}, this result {value.dtype} {list(value.shape)}"
            )
    for held, value, _ in pairs:
        np.copyto(held, value)
    for field, value in result.outputs.items():
        if not isinstance(value, Mapping | np.ndarray):
            into.outputs[field] = value  # a count
    for key in ("model_version", "weights_id", "model", "server", "plan_id"):
        into.__dict__[key] = result.__dict__[key]
    return into


def _combine(output: Output, values: list[Any]) -> Any:
    if output.rows == "example":
        return np.concatenate(values)
    return sum(values[1:], values[0])
