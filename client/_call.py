"""What one gradients call asks besides its batch, shared by `per_example_gradients` and
`stream`: the reduction and its checked options, the variables, a pinned version."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from pergrad.client._retry import time_left
from pergrad.client._types import ModelInfo, PergradError, invalid
from pergrad.wire.casting import CastError, arrays_by_input, cast
from pergrad.wire.catalogue import CATALOGUE, OptionError, Reduction
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.messages import gradients_request
from pergrad.wire.results import ExpectedOutput, GradientResult, expected_outputs

# What a request holds besides its batch's rows, its options' tensors and the names it
# carries, at most: scalar options, field tags; and per tensor, its name, dtype and shape.
REQUEST_OVERHEAD = 4 << 10
TENSOR_OVERHEAD = 128


@dataclass(frozen=True)
class Call:
    """A gradients call: `Call.of` checks the options by the catalogue."""

    model: str
    reduction: Reduction
    options: dict[str, Any]
    variables: tuple[str, ...] | None = None
    model_version: int = 0
    upcast: bool = False
    # When the call must have ended (`time.monotonic()`), its timeout from its start: its
    # parts, and their retries, share it. None: never.
    deadline: float | None = None
    # The identity of the pinned version's weights, when the client has seen it.
    weights_id: str = ""

    def delivered(self, result: GradientResult) -> GradientResult:
        """The result as the caller asked for it: gradients as float32 with `upcast`."""
        if self.upcast:
            result.gradients = {k: g.astype(np.float32) for k, g in result.gradients.items()}
        return result

    @classmethod
    def of(
        cls,
        model: str,
        *,
        reduction: str = "none",
        variables: Sequence[str] | None = None,
        model_version: int = 0,
        weights_id: str = "",
        upcast: bool = False,
        timeout: float | None = None,
        **options: Any,
    ) -> Call:
        try:
            entry = CATALOGUE.get(reduction)
            checked = CATALOGUE.check_options(entry, options)
        except OptionError as err:
            raise invalid(str(err)) from None
        names = tuple(variables) if variables is not None else None
        deadline = None if timeout is None else time.monotonic() + timeout
        return cls(model, entry, checked, names, model_version, upcast, deadline, weights_id)

    def time_left(self) -> float | None:
        """The seconds left before the call's deadline (None: it has none)."""
        return time_left(self.deadline)

    def part(self, index: int) -> Call:
        """The call for micro-batch `index` of a batch: options applied once per batch
        (noise) only on the first."""
        if index == 0:
            return self
        options = {
            o.name: o.default if o.once_per_batch else self.options[o.name]
            for o in self.reduction.options
        }
        return dataclasses.replace(self, options=options)

    def request(self, info: ModelInfo, x: Any, y: Any, *, request_id: int = 0) -> Whole:
        """The request for batch (x, y), cast to the model's dtypes; x is one array, or
        for a model of several inputs a mapping by input name (or a list in their order).
        Its arrays are copied as its messages are made (`in_chunks`): once where in chunks."""
        single = len(info.inputs) == 1
        try:
            values = arrays_by_input(x, [i.name for i in info.inputs])
            inputs = {
                spec.name: cast(
                    value, spec.dtype, what="inputs" if single else f"inputs[{spec.name!r}]"
                )
                for spec, value in zip(info.inputs, values, strict=True)
            }
            labels = cast(y, info.labels.dtype, what="labels")
        except CastError as err:
            raise invalid(str(err)) from None
        return gradients_request(
            self.model,
            next(iter(inputs.values())) if single else inputs,
            labels,
            reduction=self.reduction,
            options=self.options,
            variables=self.variables,
            model_version=self.model_version,
            weights_id=self.weights_id,
            request_id=request_id,
        )

    def examples_per_request(self, info: ModelInfo, x: Any, y: np.ndarray) -> int:
        """The most examples of batch (x, y) one request may hold under the server's
        limits on one request (`ModelInfo.limits`: max_batch, max_request_bytes), so
        that a larger batch goes in parts; RESOURCE_EXHAUSTED if one example does not
        fit beside the options' tensors (a `dot`'s references: see `reference_parts`)."""
        limits = info.limits
        most = limits.max_batch or max(rows_of(y), 1)
        if not limits.max_request_bytes:
            return most
        fixed = self._header_bytes(info) + self._tensor_bytes()
        row = _example_bytes(info, x, y)
        fits = (limits.max_request_bytes - fixed) // max(row, 1)
        if fits < 1:
            raise PergradError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a request of one example takes {fixed + row} bytes with this call's "
                f"options, over the server's max_request_bytes ({limits.max_request_bytes}, "
                "its --max-request-bytes): ask for a larger limit",
            )
        return min(most, fits)

    def reference_parts(self, info: ModelInfo) -> list[Call]:
        """This call as calls carrying some of a `dot`'s reference rows each, when all of
        them would take more than half of a request (the server's max_request_bytes),
        leaving the batch the rest; their results' dots side by side are this call's.
        Else [self]."""
        references = self.options.get("reference") if self.reduction.name == "dot" else None
        room = info.limits.max_request_bytes - self._header_bytes(info)
        if not references or not info.limits.max_request_bytes or self._tensor_bytes() <= room // 2:
            return [self]
        arrays = {name: np.asarray(value) for name, value in references.items()}
        row = sum(a[0].nbytes for a in arrays.values() if len(a))
        rows = max(1, room // 2 // max(row, 1))
        count = len(next(iter(arrays.values())))
        return [
            dataclasses.replace(
                self,
                options={
                    **self.options,
                    "reference": {n: a[s : s + rows] for n, a in arrays.items()},
                },
            )
            for s in range(0, count, rows)
        ]

    def _tensors(self) -> list[np.ndarray]:
        """The options' tensors (a `dot`'s references), sent with every part."""
        return [
            np.asarray(array)
            for option in self.reduction.options
            if option.kind == "tensors"
            for array in (self.options.get(option.name) or {}).values()
        ]

    def _tensor_bytes(self) -> int:
        return sum(array.nbytes for array in self._tensors())

    def _header_bytes(self, info: ModelInfo) -> int:
        """What a request of this call holds besides the batch's rows and the options'
        tensors' bytes, at most."""
        names = [self.model, self.weights_id, *(self.variables or ())]
        tensors = len(info.inputs) + 1 + len(self._tensors())
        return (
            REQUEST_OVERHEAD
            + sum(len(name.encode()) + 8 for name in names)
            + tensors * (TENSOR_OVERHEAD + max((len(v.name) for v in info.variables), default=0))
        )

    def expected(self, info: ModelInfo, batch: int) -> list[tuple[ExpectedOutput, np.dtype | None]]:
        """The outputs a correct result of a batch of `batch` holds, each with the dtype
        it must travel in (None: any floating-point type, the model's loss dtype)."""
        chosen = set(self.variables) if self.variables else None
        variables = [v for v in info.variables if chosen is None or v.name in chosen]
        expected = expected_outputs(
            self.reduction,
            batch=batch,
            variables=[(v.name, tuple(v.shape)) for v in variables],
            options=self.options,
        )
        dtypes = {v.name: v.dtype for v in variables}
        wire = self.options.get("wire_dtype")
        return [(e, e.dtype(dtypes, wire, loss=None)) for e in expected]


def _example_bytes(info: ModelInfo, x: Any, y: np.ndarray) -> int:
    """The bytes one example of (x, y) takes in a request, in the model's dtypes (0 for
    inputs that do not fit the model: `Call.request` names what is wrong)."""
    try:
        values = arrays_by_input(x, [i.name for i in info.inputs])
        shapes = [np.shape(v)[1:] for v in values]
    except (CastError, ValueError):
        return 0
    inputs = sum(
        int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
        for spec, shape in zip(info.inputs, shapes, strict=False)
    )
    return inputs + int(np.prod(y.shape[1:], dtype=np.int64)) * info.labels.dtype.itemsize


def rows_of(y: np.ndarray) -> int:
    """The examples an array of inputs or labels holds (0 for a scalar: the server names
    what is wrong)."""
    return int(y.shape[0]) if y.ndim else 0


def request_examples(request: Whole) -> int:
    """The examples a request's labels declare."""
    labels = request.message.labels
    return int(labels.shape[0]) if labels.shape else 0


def batch_of(info: ModelInfo, x: Any, y: np.ndarray) -> dict[str, np.ndarray]:
    """x as one array per input name, refused (INVALID_ARGUMENT) unless each holds a row
    per label: what a batch is split from (a part would drop rows silently)."""
    try:
        values = arrays_by_input(x, [i.name for i in info.inputs])
        arrays = {i.name: np.asarray(v) for i, v in zip(info.inputs, values, strict=True)}
    except (CastError, ValueError) as err:
        raise invalid(f"inputs: {err}") from None
    rows = {name: rows_of(a) for name, a in arrays.items()}
    if y.ndim == 0 or any(n != len(y) for n in rows.values()):
        raise invalid(
            f"inputs hold {rows} examples and labels {rows_of(y)}: one row per label needed"
        )
    return arrays
