"""pergrad's client: per-example gradients from a pergrad server as numpy arrays.

Needs numpy, grpcio and protobuf only; it never imports TensorFlow.
"""

from pergrad.client._client import GradientClient
from pergrad.client._types import GradientResult, ModelInfo, PergradError, TensorInfo

__all__ = ["GradientClient", "GradientResult", "ModelInfo", "PergradError", "TensorInfo"]
