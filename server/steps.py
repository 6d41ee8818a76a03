"""One ApplyStep: the step's gradient (a batch's reduction, priced by admission like a
gradients request's, or a sum the caller gives), divided by the expected batch size,
applied by the model's optimizer (`training.Trainer`) and made current (`weights`).

A model's steps take turns, each from the weights the last one left; its pins are
checked once its turn comes, after its id (`recent_steps`): a step sent again is answered,
not applied twice. Nothing is made current before the last check: a step
refused, failed or cancelled on the way leaves the weights and optimizer state as they
were.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.server.gradients import Charge, Settings, prepare, reduced
from pergrad.server.models.registry import ServedModel
from pergrad.server.recent_steps import checked_step_id
from pergrad.server.weights import Snapshot
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import STEP_SUMS
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.results import GradientResult

_FLOAT32_MAX = float(np.finfo(np.float32).max)
# GradientsRequest fields the step sets itself, so its batch leaves them unset.
_STEP_OWNED = ("model", "model_version", "weights_id", "variables")


@dataclass(frozen=True)
class Step:
    """What a step made current, and what the caller logs of it."""

    snapshot: Snapshot
    result: GradientResult | None  # the batch's; None for a given sum
    gradient_norm: float
    moved: dict[str, float]  # ||new - old|| by variable name


def apply_step(
    served: ServedModel,
    whole: Whole,
    settings: Settings,
    charge: Charge,
    respond: Callable[[Step], pb.StepResponse],
) -> tuple[pb.StepResponse, bool]:
    """The step `whole` (a StepRequest) asks for, applied and made current, and its
    response (`respond`), True; or, for a step of an id the model applied recently (sent
    again, its reply lost), that step's response, False. The id is looked up and recorded
    in the model's turn, so a step sent twice at once is applied once."""
    request = whole.message
    learning_rate, given = _checked(request)
    step_id = checked_step_id(request.step_id)
    cancelled = charge.cancelled
    with served.trainer.turn(cancelled):
        done = served.recent_steps.get(step_id)
        if done is not None:
            return done, False
        snapshot = served.weights.get(request.model_version, request.weights_id)
        result: GradientResult | None = None
        total: Mapping[str, np.ndarray]
        if given:
            total = _given_sum(served, whole)
            divisor = request.expected_batch_size
        else:
            result, total = _batch_sum(served, whole.part("batch"), snapshot, settings, charge)
            divisor = request.expected_batch_size or result.batch_size
        gradient = _divided(served, total, divisor)
        stepped = served.trainer.apply(
            snapshot.trainable, snapshot.optimizer_state, gradient, learning_rate
        )
        if cancelled():
            raise Cancelled("the call was cancelled; the step was not applied")
        new = served.weights.advance(
            snapshot,
            stepped.weights,
            stepped.state,
            new_version=request.new_version,
            finite=stepped.finite,
        )
        moved = dict(zip((v.name for v in served.engine.variables), stepped.moved, strict=True))
        response = respond(Step(new, result, stepped.gradient_norm, moved))
        served.recent_steps.add(step_id, response)
    return response, True


def _checked(request: pb.StepRequest) -> tuple[float, bool]:
    """The step's learning rate, and whether it gives its gradient sum (else a batch)."""
    learning_rate = _positive(request.learning_rate, "learning_rate")
    given = bool(request.gradient_sum)
    if request.HasField("batch") == given:
        raise InvalidArgument("ApplyStep: set exactly one of batch and gradient_sum")
    if given and not request.expected_batch_size:
        raise InvalidArgument("expected_batch_size: required with gradient_sum")
    if request.expected_batch_size:
        _positive(request.expected_batch_size, "expected_batch_size")
    return learning_rate, given


def _batch_sum(
    served: ServedModel,
    batch: Whole,
    snapshot: Snapshot,
    settings: Settings,
    charge: Charge,
) -> tuple[GradientResult, Mapping[str, np.ndarray]]:
    """The batch's result at `snapshot`, and its gradient sum."""
    owned = [f for f in _STEP_OWNED if _is_set(batch.message, f)]
    if owned:
        raise InvalidArgument(f"batch: {owned} are the step's own; leave them unset in batch")
    work = prepare(served, batch, settings)
    name = work.asked.reduction.name
    if name not in STEP_SUMS:
        raise InvalidArgument(f"batch.reduction: a step applies {sorted(STEP_SUMS)}, got {name}")
    work = dataclasses.replace(work, snapshot=snapshot)
    result = reduced(work, charge)
    return result, getattr(result, STEP_SUMS[name])


def _is_set(message: pb.GradientsRequest, field: str) -> bool:
    value = getattr(message, field)
    return bool(len(value)) if field == "variables" else bool(value)


def _given_sum(served: ServedModel, request: Whole) -> dict[str, np.ndarray]:
    """The sum a StepRequest gives: float32 (whatever the variables' dtypes), one tensor
    of each variable's shape."""
    arrays = {
        name: request.array(tensor, ("gradient_sum", name))
        for name, tensor in request.message.gradient_sum.items()
    }
    wrong = sorted(name for name, a in arrays.items() if a.dtype != np.float32)
    if wrong:
        raise InvalidArgument(f"gradient_sum {wrong}: must be float32")
    dtypes = {v.name: v.dtype for v in served.engine.variables}
    served.weights.check([(n, dtypes.get(n, a.dtype), a.shape) for n, a in arrays.items()])
    bad = sorted(name for name, a in arrays.items() if not np.isfinite(a).all())
    if bad:
        raise InvalidArgument(f"gradient_sum {bad} hold NaN or infinity")
    return arrays


def _divided(
    served: ServedModel, total: Mapping[str, np.ndarray], divisor: float
) -> list[np.ndarray]:
    """sum / divisor in float32 (the divisor rounded to float32), in model order."""
    scale = np.float32(divisor)
    with np.errstate(over="ignore"):  # a step that overflows is refused when it commits
        return [
            np.divide(total[v.name], scale, dtype=np.float32).astype(v.dtype, copy=False)
            for v in served.engine.variables
        ]


def _positive(value: float, field: str) -> float:
    """A finite number > 0 that stays one in float32, the dtype the step computes in."""
    if not (math.isfinite(value) and value <= _FLOAT32_MAX and np.float32(value) > 0):
        raise InvalidArgument(f"{field}: a finite number > 0 (float32), got {value}")
    return value
