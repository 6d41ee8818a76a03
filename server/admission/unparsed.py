"""Refusals read from a request's bytes before it is parsed, per method: a message that
holds more fields than any request to a served model could, a SetWeights header larger
than a served model's. Parsing a message of many small fields holds the GIL every other
call waits for (upb: ~1 us a field), so these are read from the bytes first; a message of
a few large fields (tensors) parses at memory speed and is checked once parsed (a message
is 4 MiB at most: MESSAGE_BYTES). And --max-request-bytes resolved for the served models
(`request_bytes_limit`)."""

from __future__ import annotations

from functools import partial

import numpy as np

from pergrad.server.config import Config
from pergrad.server.errors import InvalidArgument, PergradServerError, RefusedUnparsed
from pergrad.server.model_info import variable_specs
from pergrad.server.models.registry import ModelRegistry, ServedModel
from pergrad.server.status import Refusal
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.declared import declared_model, first_nested_string, holds_over
from pergrad.wire.fields import field_bytes


def _unsplittable_bytes(served: ServedModel) -> int:
    """What a request to the model holds that no client can split: one value per
    variable element, float32 at least (a `dot` reference row, or a step's gradient
    sum), and one example (a dimension of free size counted as 1)."""
    engine = served.engine
    variables = sum(
        int(np.prod(v.shape, dtype=np.int64)) * max(4, np.dtype(v.dtype).itemsize)
        for v in engine.variables
    )
    example = [(s.shape, s.dtype) for s in engine.input_specs]
    example.append((engine.label_spec.shape, engine.label_spec.dtype))
    return variables + sum(
        int(np.prod([d or 1 for d in shape], dtype=np.int64)) * np.dtype(dtype).itemsize
        for shape, dtype in example
    )


def request_bytes_limit(config: Config, registry: ModelRegistry) -> int:
    """--max-request-bytes, auto resolved for the served models (`Config.request_bytes_bound`)."""
    most = max((_unsplittable_bytes(registry.get(n)) for n in registry.names), default=0)
    return config.request_bytes_bound(most)


def _header_bound(registry: ModelRegistry) -> int:
    """Twice the bytes of the largest WeightsHeader a served model takes, every field at
    its widest, and 4 KiB: room for shapes sent unpacked and fields a newer client sets."""
    sizes = [
        pb.WeightsHeader(
            model=name,
            model_version=-1,
            new_version=-1,
            weights_id="0" * 32,
            tensors=variable_specs(registry.get(name)),
        ).ByteSize()
        for name in registry.names
    ]
    return 2 * max(sizes, default=0) + 4096


def _fields_needed(registry: ModelRegistry) -> int:
    """The most top-level fields a request to a served model holds: a variable name and
    a `dot` reference (or a step's gradient-sum tensor) per variable, a tensor per
    input, every other field once."""
    most = max(
        (
            2 * len(registry.get(name).engine.variables)
            + len(registry.get(name).engine.input_specs)
            for name in registry.names
        ),
        default=0,
    )
    others = max(len(pb.GradientsRequest.DESCRIPTOR.fields), len(pb.StepRequest.DESCRIPTOR.fields))
    return most + others


class Unparsed:
    """The refusals of the served models' requests from their bytes (`by_method`)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._header_bound = _header_bound(registry)
        self._fields_needed = _fields_needed(registry)
        # Twice as many, and 64: room for fields sent twice and fields a newer client sets.
        self._field_bound = 2 * self._fields_needed + 64

    def by_method(self) -> dict[str, Refusal]:
        """Per method, what refuses a request from its bytes before it is parsed."""
        many = self._too_many_fields
        step_batch = pb.StepRequest.BATCH_FIELD_NUMBER
        return {
            "SetWeights": self.oversized_header,
            "ComputePerExampleGradients": partial(many, "GradientsRequest"),
            "StreamPerExampleGradients": partial(many, "GradientsRequest"),
            "ApplyStep": _naming_its_model(
                partial(many, "StepRequest (or its batch)", in_field=step_batch)
            ),
        }

    def oversized_header(self, data: bytes) -> InvalidArgument | None:
        """The refusal of a SetWeights message whose header is larger than any served
        model's could be, unparsed (parsing 60,000 specs would hold the GIL 5 ms),
        naming the model it would update (`SetWeights` counts the failure)."""
        size = field_bytes(data, pb.WeightsMessage.HEADER_FIELD_NUMBER)
        if size <= self._header_bound:
            return None
        return RefusedUnparsed(
            f"WeightsMessage: a header of {size} bytes; the bound is {self._header_bound}, "
            "twice the largest a served model takes plus 4 KiB (one TensorSpec per "
            "trainable variable: GetModelInfo lists them)",
            model=first_nested_string(
                data, pb.WeightsMessage.HEADER_FIELD_NUMBER, pb.WeightsHeader.MODEL_FIELD_NUMBER
            ),
        )

    def _too_many_fields(self, what: str, data: bytes, in_field: int = 0) -> InvalidArgument | None:
        """The refusal of a request holding more fields than any request to a served model
        could (`_field_bound`), unparsed: upb takes ~1 us a small field, with the GIL held
        (80,000 `dot` references, 0.9 MiB: 90 ms). A message of n bytes holds n/2 fields
        at most, so only longer ones are read."""
        if len(data) <= 2 * self._field_bound or not holds_over(data, self._field_bound, in_field):
            return None
        return InvalidArgument(
            f"{what}: over {self._field_bound} fields, the bound: twice the "
            f"{self._fields_needed} a request to this server's models holds at most (a "
            "variable name and a `dot` reference or gradient-sum tensor per variable, a "
            "tensor per input, every other field once), and 64; or a group, which no "
            "proto3 message holds"
        )


def _naming_its_model(refuse: Refusal) -> Refusal:
    """`refuse`, its refusals naming the model a StepRequest's bytes name, if any (an
    ApplyStep refused counts as a failed update for it: `service`)."""

    def refuse_naming(data: bytes) -> PergradServerError | None:
        error = refuse(data)
        if error is None:
            return None
        return RefusedUnparsed(
            str(error), model=declared_model(data, pb.StepRequest.MODEL_FIELD_NUMBER)
        )

    return refuse_naming
