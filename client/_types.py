"""Result and description types shared by the client and the in-process engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from pergrad.client._codec import numpy_dtype
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2


class PergradError(Exception):
    """A failed pergrad call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype and shape of a tensor; -1 in `shape` stands for the batch."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def from_proto(cls, spec: tensor_pb2.TensorSpec) -> TensorInfo:
        return cls(spec.name, numpy_dtype(spec.dtype), tuple(spec.shape))


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_version: int
    variables: tuple[TensorInfo, ...]
    input: TensorInfo
    labels: TensorInfo
    loss: str
    num_classes: int
    server: str = ""

    @classmethod
    def from_proto(cls, info: pb.ModelInfo) -> ModelInfo:
        return cls(
            name=info.name,
            model_version=info.model_version,
            variables=tuple(TensorInfo.from_proto(v) for v in info.variables),
            input=TensorInfo.from_proto(info.input),
            labels=TensorInfo.from_proto(info.labels),
            loss=info.loss,
            num_classes=info.num_classes,
            server=info.server,
        )

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(v.shape)) for v in self.variables)


@dataclass
class GradientResult:
    """Per-example results of one batch; which fields are set depends on the reduction.

    Attributes:
        losses: per-example loss, [B] (always).
        gradients: variable -> per-example gradient [B, *shape] (reduction "none").
        norms: per-example L2 norm of the whole (selected) gradient, [B] ("norms",
            "clipped_sum").
        variable_norms: variable -> per-example L2 norm, [B] ("norms").
        clipped_sum: variable -> sum of clipped per-example gradients plus noise
            ("clipped_sum"); num_clipped: how many examples were clipped.
        sum, sum_squares: variable -> sum over examples of g and of g**2 ("moments").
        dots: [B, K] dot products with K reference gradients ("dot").
        projections: [B, dim] random projections ("project").
        model_version: the weights version every tensor was computed with.
        model: the model's name.
        server: the replica(s) that computed it.
    """

    losses: np.ndarray
    gradients: dict[str, np.ndarray] = field(default_factory=dict)
    model_version: int = 0
    model: str = ""
    norms: np.ndarray | None = None
    variable_norms: dict[str, np.ndarray] = field(default_factory=dict)
    clipped_sum: dict[str, np.ndarray] = field(default_factory=dict)
    num_clipped: int | None = None
    sum: dict[str, np.ndarray] = field(default_factory=dict)
    sum_squares: dict[str, np.ndarray] = field(default_factory=dict)
    dots: np.ndarray | None = None
    projections: np.ndarray | None = None
    server: str = ""

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
