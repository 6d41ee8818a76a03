"""The ModelInfo a server answers for a served model: its variables, inputs and labels as
the wire names them, the server's limits, the plan its passes follow, its loss,
optimizer, routes and LoRA."""

from __future__ import annotations

import numpy as np

from pergrad.server.config import Config
from pergrad.server.models.registry import ServedModel
from pergrad.server.sharing import served_plan
from pergrad.server.training import KERAS_VERSION
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.codec import wire_dtype


def variable_specs(served: ServedModel) -> list[tensor_pb2.TensorSpec]:
    """Each trainable variable as GetModelInfo lists it and a SetWeights header names it."""
    return [
        tensor_pb2.TensorSpec(name=v.name, dtype=wire_dtype(v.dtype), shape=v.shape)
        for v in served.engine.variables
    ]


def _batched_spec(
    name: str, dtype: np.dtype, shape: tuple[int | None, ...]
) -> tensor_pb2.TensorSpec:
    """Spec with -1 for the batch and for any per-example dimension of free size."""
    dims = [-1, *(-1 if d is None else d for d in shape)]
    return tensor_pb2.TensorSpec(name=name, dtype=wire_dtype(dtype), shape=dims)


def model_info(served: ServedModel, config: Config, max_request_bytes: int) -> pb.ModelInfo:
    """`served`'s ModelInfo on a server of `config` (its coalescing resolved)."""
    engine, coalescing = served.engine, config.max_coalesced_batch or 0
    plan, plan_id = served_plan(engine, coalescing)
    return pb.ModelInfo(
        name=served.name,
        model_version=served.weights.current.version,
        weights_id=served.weights.current.weights_id,
        variables=variable_specs(served),
        input=_batched_spec("input", engine.input_spec.dtype, engine.input_spec.shape),
        inputs=[_batched_spec(i.name, i.dtype, i.shape) for i in engine.input_specs],
        labels=_batched_spec("labels", engine.label_spec.dtype, engine.label_spec.shape),
        loss=engine.loss.description,
        num_classes=engine.label_spec.num_classes,
        server=config.replica_name,
        limits=pb.ServerLimits(
            max_batch=config.max_batch,
            max_request_bytes=max_request_bytes,
            max_inflight_examples=config.max_inflight_examples,
            max_inflight_bytes=config.max_inflight_bytes,
            max_coalesced_batch=coalescing,
        ),
        plan=plan,
        plan_id=plan_id,
        loss_dtype=wire_dtype(engine.loss_dtype),
        optimizer=served.trainer.description,
        routes=engine.routes,
        lora=served.lora,
        keras_version=KERAS_VERSION,
    )
