"""A gradients request's results as they leave the server: a float16 result that would
overflow is refused, never sent as infinity."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.errors import FailedPrecondition
from pergrad.server.gradients import _on_wire
from pergrad.wire.casting import dtype_named
from tests.helpers import batch_for


@pytest.mark.parametrize("size", [4, 300], ids=["shared pass", "alone, streamed"])
def test_a_result_that_overflows_float16_is_refused_not_sent_as_infinity(
    client: GradientClient, size: int
) -> None:
    """Inputs of about 1e6 make gradients of about 1e6: finite in float32, past FLOAT16's
    largest, 65504. The proto promises no result holding infinity: the call is
    FAILED_PRECONDITION, naming the dtype, its largest value and what to ask for
    instead, and BFLOAT16 of the same batch is served (before: streamed with infinities,
    OK)."""
    x, y = batch_for((784,), 10, size)
    x *= 1e6
    with pytest.raises(PergradError) as err:
        client.per_example_gradients("mnist_mlp", x, y, wire_dtype="float16")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "overflows float16 on the wire (largest 65504)" in err.value.message
    assert "ask for wire_dtype FLOAT32 or BFLOAT16" in err.value.message
    exact = client.per_example_gradients("mnist_mlp", x, y)
    assert max(float(np.abs(g).max()) for g in exact.gradients.values()) >= 65520
    halved = client.per_example_gradients("mnist_mlp", x, y, wire_dtype="bfloat16")
    bfloat16 = dtype_named("bfloat16")
    for name, gradient in exact.gradients.items():
        np.testing.assert_array_equal(halved.gradients[name], gradient.astype(bfloat16))


def _below(value: float) -> np.float32:
    return np.nextafter(np.float32(value), np.float32(0))


@pytest.mark.parametrize(
    ("wire", "overflows"),
    [("float16", 65520.0), ("bfloat16", (2 - 2**-8) * 2.0**127)],
)
def test_the_wire_overflows_where_the_proto_says(wire: str, overflows: float) -> None:
    """GradientsRequest.wire_dtype's thresholds, rounding to nearest even: FLOAT16 keeps
    magnitudes below 65520 (as 65504 at most), BFLOAT16 below (2 - 2^-8) * 2^127; a
    magnitude from there is refused, of either sign."""
    dtype = dtype_named(wire)
    kept = _on_wire(np.array([_below(overflows), -_below(overflows)], np.float32), dtype, "v")
    largest = float(np.finfo(dtype).max)
    np.testing.assert_array_equal(kept.astype(np.float64), [largest, -largest])
    for value in (overflows, -overflows):
        with pytest.raises(FailedPrecondition, match=f"overflows {wire} on the wire"):
            _on_wire(np.array([1.0, value], np.float32), dtype, "v")


def test_float16_on_the_wire_flushes_to_zero_where_the_proto_says() -> None:
    """2^-25, half FLOAT16's smallest subnormal (2^-24), is a tie that rounds to even:
    zero; anything above it rounds to 2^-24 at least."""
    tiny = np.array([2.0**-25, np.nextafter(np.float32(2**-25), np.float32(1))], np.float32)
    np.testing.assert_array_equal(_on_wire(tiny, np.dtype(np.float16), "v"), [0.0, 2.0**-24])
