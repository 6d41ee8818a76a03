"""Per-example gradients in TensorFlow; no gRPC here, usable in-process.

from pergrad.server.engine import Engine
result = Engine(model, loss="sparse_categorical_crossentropy").per_example_gradients(x, y)
"""

from pergrad.server.engine.batch import Batch, InputSpec
from pergrad.server.engine.blocks import SliceResult
from pergrad.server.engine.engine import Engine
from pergrad.server.engine.slices import VariableSpec

__all__ = ["Batch", "Engine", "InputSpec", "SliceResult", "VariableSpec"]
