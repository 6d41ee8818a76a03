"""GradientsRequests and ResultHeaders <-> the catalogue's terms.

The client builds requests with `gradients_request`; the server reads them back with
`parse_request`, which checks every option by the same catalogue. Results travel as a
header listing `ResultTensor`s (field, variable, dtype, shape) and then chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.catalogue import (
    CATALOGUE,
    Catalogue,
    CheckedOptions,
    Option,
    OptionError,
    Reduction,
)
from pergrad.wire.chunked_requests import Key, Whole
from pergrad.wire.codec import CodecError, announced_tensor, wire_dtype
from pergrad.wire.results import GradientResult

_REQUEST_FIELDS = pb.GradientsRequest.DESCRIPTOR.fields_by_name


@dataclass(frozen=True)
class Asked:
    """What a GradientsRequest asks for, its options checked and defaults filled in."""

    reduction: Reduction
    variables: list[str] | None
    options: CheckedOptions


def _enum(option: Option) -> Any:  # protobuf's EnumDescriptor, pure-Python or upb's
    enum = _REQUEST_FIELDS[option.field].enum_type
    assert enum is not None, f"{option.field} is declared an enum option"
    return enum


def _enum_number(option: Option, choice: str) -> int:
    values = _enum(option).values_by_name
    return values[option.enum_prefix + choice.upper()].number


def _enum_choice(option: Option, number: int) -> str:
    values = _enum(option).values_by_number
    if number not in values:
        raise OptionError(f"{option.field}: unknown value {number}")
    return values[number].name.removeprefix(option.enum_prefix).lower()


def _set_option(
    request: pb.GradientsRequest, arrays: dict[Key, np.ndarray], option: Option, value: Any
) -> None:
    if option.kind == "tensors":
        tensors = getattr(request, option.field)
        for name, array in value.items():
            key = (option.field, str(name))  # the string protobuf keeps for the key
            arrays[key] = _announced(tensors[name], np.asarray(array, np.float32))
    elif option.kind == "choice":
        setattr(request, option.field, _enum_number(option, value))
    else:
        setattr(request, option.field, value)


def _announced(tensor: tensor_pb2.Tensor, array: Any) -> np.ndarray:
    """`array`, announced as `tensor` (its bytes beside the message: `Whole`)."""
    array = np.asarray(array)
    tensor.CopyFrom(announced_tensor(array))
    return array


def gradients_request(
    model: str,
    x: np.ndarray | Mapping[str, np.ndarray],
    y: np.ndarray,
    *,
    reduction: Reduction,
    options: Mapping[str, Any],
    variables: Sequence[str] | None = None,
    model_version: int = 0,
    weights_id: str = "",
    request_id: int = 0,
) -> Whole:
    """A request for `reduction` with checked `options` (None or a default: not sent); `x`
    one array (`inputs`) or one per input name (`named_inputs`); its tensors arrays beside
    its message (`in_chunks` sends them; `Whole.inline` puts them in it). It asks for a
    small result in one message (`inline_result`; `pergrad.client` reads both forms)."""
    request = pb.GradientsRequest(
        model=model,
        model_version=model_version,
        weights_id=weights_id,
        request_id=request_id,
        reduction=cast(pb.Reduction, reduction.number),  # the enum's value, as an int
        variables=list(variables or ()),
        inline_result=True,
    )
    arrays: dict[Key, np.ndarray] = {("labels", None): _announced(request.labels, y)}
    if isinstance(x, Mapping):
        for name, array in x.items():
            key = ("named_inputs", str(name))  # the string protobuf keeps for the key
            arrays[key] = _announced(request.named_inputs[name], array)
    else:
        arrays["inputs", None] = _announced(request.inputs, x)
    for option in reduction.options:
        value = options.get(option.name)
        if value is not None and not (value == option.default and not option.required):
            _set_option(request, arrays, option, value)
    return Whole(request, arrays)


def _is_set(request: pb.GradientsRequest, field: str) -> bool:
    descriptor = _REQUEST_FIELDS[field]
    if descriptor.has_presence:
        return request.HasField(field)
    return bool(getattr(request, field))


def _get_option(request: Whole, option: Option) -> Any:
    value = getattr(request.message, option.field)
    if option.kind == "tensors":  # cast and checked by the catalogue, as in-process
        return {name: request.array(tensor, (option.field, name)) for name, tensor in value.items()}
    if option.kind == "choice":
        return _enum_choice(option, value)
    return value


def parse_request(request: pb.GradientsRequest | Whole, catalogue: Catalogue = CATALOGUE) -> Asked:
    """The reduction, variables and checked options of `request` (OptionError or
    CodecError say what is wrong)."""
    whole = Whole.of(request)
    message = whole.message
    reduction = catalogue.by_number(message.reduction)
    own = {option.field for option in reduction.options}
    others = [o for o in catalogue.options() if o.field not in own]
    raw = {
        option.name: _get_option(whole, option)
        for option in [*reduction.options, *others]
        if _is_set(message, option.field)
    }
    options = catalogue.check_options(reduction, raw)
    return Asked(reduction, list(message.variables) or None, options)


def result_header(
    *,
    model: str,
    model_version: int,
    weights_id: str,
    batch_size: int,
    server: str,
    outputs: Sequence[tuple[str, str, Sequence[int], np.dtype]],
    plan_id: str = "",
) -> pb.ResultHeader:
    """The header announcing `outputs`: (field, variable or "", shape, dtype) each."""
    return pb.ResultHeader(
        model=model,
        model_version=model_version,
        weights_id=weights_id,
        batch_size=batch_size,
        server=server,
        plan_id=plan_id,
        outputs=[
            pb.ResultTensor(
                field=field,
                tensor=tensor_pb2.TensorSpec(name=name, dtype=wire_dtype(dtype), shape=shape),
            )
            for field, name, shape, dtype in outputs
        ],
    )


def result_arrays(result: GradientResult) -> list[tuple[str, str, np.ndarray]]:
    """(field, variable, array) of every tensor `result` holds: losses, then its outputs."""
    tensors = [("losses", "", np.asarray(result.losses))]
    for field, value in result.outputs.items():
        if isinstance(value, Mapping):
            tensors += [(field, name, np.asarray(array)) for name, array in value.items()]
        else:
            tensors.append((field, "", np.asarray(value)))
    return tensors


def result_from_arrays(
    header: pb.ResultHeader, arrays: Sequence[np.ndarray], catalogue: Catalogue = CATALOGUE
) -> GradientResult:
    """The result a header and its filled tensors make; CodecError for an output field
    this version of pergrad does not know."""
    outputs: dict[str, Any] = {}
    losses = None
    for spec, array in zip(header.outputs, arrays, strict=True):
        if spec.field == "losses":
            losses = array
            continue
        try:
            output = catalogue.output(spec.field)
        except KeyError:
            raise CodecError(
                f"server sent output field {spec.field!r}, unknown to this client; upgrade it"
            ) from None
        if output.per_variable:
            outputs.setdefault(spec.field, {})[spec.tensor.name] = array
        elif output.rows == "count":
            outputs[spec.field] = int(array)
        else:
            outputs[spec.field] = array
    if losses is None:
        raise CodecError("server sent a result without losses")
    return GradientResult(
        losses,
        model_version=header.model_version,
        weights_id=header.weights_id,
        model=header.model,
        server=header.server,
        plan_id=header.plan_id,
        catalogue=catalogue,
        **outputs,
    )
