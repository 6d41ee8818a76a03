"""What a pass gives: the variables it differentiates (`VariableSpec`) and, per slice of a
batch, the losses and each variable's per-example gradient (`Slice`); the engine makes
them, blocks and sinks read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pergrad.server.engine.grads import Grad


@dataclass(frozen=True)
class VariableSpec:
    """A trainable variable: its position in the model's order, name, dtype and shape."""

    index: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


class Slice(NamedTuple):
    """One pass over examples [start, stop): losses [n] and each variable's numpy
    per-example gradient (dense or factored, see `grads`), in model order; read-only
    views of the pass's buffers (`grads.host`), to be copied before writing."""

    start: int
    stop: int
    losses: np.ndarray
    grads: list[Grad]
