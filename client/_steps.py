"""Training steps on the server (ApplyStep): one call with the batch on one server; on
several replicas, the gradient sum computed once and the same update sent to each."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from pergrad.client._call import Call
from pergrad.client._methods import Methods
from pergrad.client._retry import retried
from pergrad.client._types import ModelInfo, PergradError, answer_checked, invalid
from pergrad.client._weights import WeightsWriter
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import STEP_SUMS
from pergrad.wire.chunked_requests import Key, Whole
from pergrad.wire.codec import announced_tensor, decode_tensor
from pergrad.wire.results import GradientResult


@dataclass(frozen=True)
class StepResult:
    """What a step made current and what a trainer logs of it.

    Attributes:
        model_version, weights_id: the weights the step made current (on every replica).
        losses: the batch's per-example losses [B].
        norms: per-example gradient norms before clipping [B] ("clipped_sum"; else None).
        num_clipped: examples whose norm exceeded max_norm ("clipped_sum"; else 0).
        gradient_norm: the L2 norm of the gradient the optimizer applied (sum / divisor).
        server: the replica(s) that applied it, comma-separated.
        update_norms: how far the step moved each variable, ||new - old|| by name: a
            variable that stays at 0 trains nothing (see `unmoved`).
    """

    model_version: int
    weights_id: str
    losses: np.ndarray
    norms: np.ndarray | None
    num_clipped: int
    gradient_norm: float
    server: str
    update_norms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def unmoved(self) -> list[str]:
        """The variables this step left exactly where they were."""
        return sorted(name for name, norm in self.update_norms.items() if norm == 0)


def step_call(call: Call) -> Call:
    """The batch's part of a step: a reduction a step applies, no pins of its own."""
    if call.reduction.name not in STEP_SUMS:
        raise invalid(f"reduction: a step applies {sorted(STEP_SUMS)}, got {call.reduction.name}")
    if call.variables is not None:
        raise invalid("variables: a step updates every variable; leave it unset")
    return dataclasses.replace(call, model="", model_version=0, weights_id="")


def step_request(call: Call, learning_rate: float, expected_batch_size: float) -> pb.StepRequest:
    """The step's request, its batch set by the path that sends it (`on_one`, `on_all`),
    with an id of its own (sent again, it is not applied twice)."""
    return pb.StepRequest(
        step_id=os.urandom(16).hex(),
        model=call.model,
        model_version=call.model_version,
        weights_id=call.weights_id,
        learning_rate=learning_rate,
        expected_batch_size=expected_batch_size,
    )


def on_one(
    stub_call: Any,
    info: ModelInfo,
    call: Call,
    x: Any,
    y: Any,
    step: pb.StepRequest,
    retries: int,
) -> StepResult:
    """The whole step in one ApplyStep: the batch goes, the weights stay on the server.
    `call` is the batch's part (`step_call`), with the step's deadline. Sent again while
    the server is unavailable: its step_id keeps a server from applying it twice."""
    sent = call.request(info, x, y).within(step, "batch")  # its arrays sent from where they are
    reply = retried(lambda left: stub_call(sent, timeout=left), retries, call.deadline)
    with answer_checked(f"step of {info.name!r}: "):
        losses = decode_tensor(reply.losses, what="losses")
        norms = decode_tensor(reply.norms, what="norms") if reply.HasField("norms") else None
    return StepResult(
        reply.model_version,
        reply.weights_id,
        losses,
        norms,
        int(reply.num_clipped),
        reply.gradient_norm,
        reply.server,
        dict(reply.update_norms),
    )


def on_all(
    writer: WeightsWriter,
    info: ModelInfo,
    result: GradientResult,
    call: Call,
    step: pb.StepRequest,
    retries: int,
) -> StepResult:
    """Every replica applies the same sum (of `result`, computed on any of them at its
    weights) with one new version, pinned to the weights the sum was computed with (and
    sent again to a replica while it is unavailable), within `call`'s deadline."""
    total = getattr(result, STEP_SUMS[call.reduction.name])
    arrays: dict[Key, np.ndarray] = {}
    for name, array in total.items():
        arrays["gradient_sum", name] = summed = np.asarray(array, np.float32)
        step.gradient_sum[name].CopyFrom(announced_tensor(summed))
    step.weights_id = result.weights_id
    step.expected_batch_size = step.expected_batch_size or result.batch_size
    step.new_version = writer.next_version(info.name, call.time_left())
    sent = Whole(step, arrays)  # each replica's messages made from the arrays

    def apply(methods: Methods) -> pb.StepResponse:
        return retried(lambda left: methods.step(sent, timeout=left), retries, call.deadline)

    replies = writer.on_all(apply)
    first = replies[0]
    if any(r.weights_id != first.weights_id for r in replies):
        made = ", ".join(f"{r.server}: {r.weights_id}" for r in replies)
        raise PergradError(
            grpc.StatusCode.DATA_LOSS,
            f"replicas made different weights from one step ({made}): their optimizer "
            "states differ (one set since it restarted?); set_weights on all of them "
            "starts every state afresh",
        )
    return StepResult(
        first.model_version,
        first.weights_id,
        result.losses,
        result.norms,
        int(result.num_clipped or 0),
        first.gradient_norm,
        ",".join(r.server for r in replies),
        dict(first.update_norms),
    )
