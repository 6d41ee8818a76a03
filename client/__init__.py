"""pergrad's client: per-example gradients from a pergrad server as numpy arrays.

Needs numpy, grpcio and protobuf only; it never imports TensorFlow or the server.
"""

from pergrad.client._client import GradientClient
from pergrad.client._credentials import Security
from pergrad.client._steps import StepResult
from pergrad.client._types import (
    MixedPlansWarning,
    ModelInfo,
    PergradError,
    ServerLimits,
    TensorInfo,
)
from pergrad.wire.results import GradientResult

__all__ = [
    "GradientClient",
    "GradientResult",
    "MixedPlansWarning",
    "ModelInfo",
    "PergradError",
    "Security",
    "ServerLimits",
    "StepResult",
    "TensorInfo",
]
