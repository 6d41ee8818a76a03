"""Embedding ids a layer computes are checked before the pass, with XLA and without (the
family's gradients against the oracle are the zoo test's)."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.server.engine import Engine
from pergrad.server.errors import InvalidArgument
from tests.zoo import FAMILIES, VOCABULARY


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("bad_id", [-1, VOCABULARY])
def test_computed_ids_outside_the_table_are_refused_naming_the_examples(
    jit_compile: bool, bad_id: int
) -> None:
    """Before: XLA clamped an id past the table to its last row, and without XLA Keras
    wrapped -1 to the table's last row, each answering for another id without a word."""
    model, loss = FAMILIES["computed_ids"].build()
    engine = Engine(model, loss=loss, jit_compile=jit_compile)
    x = np.array([[1, 2, 3], [4, bad_id, 6], [7, 8, 9]], np.float32)
    pattern = rf"examples \[1\] give embedding .* outside \[0, {VOCABULARY}\)"
    with pytest.raises(InvalidArgument, match=pattern):
        engine.per_example_gradients(x, np.array([0, 1, 2]))
