"""Reductions over the wire: the client gets what the in-process engine computes, and what
the Keras-only oracle (tests/oracle.py) says they are."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.engine import Engine
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.casting import dtype_named
from pergrad.wire.codec import encode_tensor, numpy_dtype
from tests import oracle
from tests.helpers import assert_close, batch_for


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS["mnist_cnn"](), loss=LOSS, jit_compile=False)


def _batch(size: int = 9):
    return batch_for((28, 28, 1), 10, size, seed=7)


@pytest.mark.parametrize(
    ("reduction", "options", "fields"),
    [
        ("norms", {}, ["norms", "variable_norms"]),
        (
            "clipped_sum",
            {"max_norm": 1.0, "noise_multiplier": 0.5, "seed": 3},
            ["clipped_sum", "norms", "num_clipped"],
        ),
        ("moments", {}, ["sum", "sum_squares"]),
        ("project", {"dim": 64, "seed": 2, "projection": "gaussian"}, ["projections"]),
    ],
)
def test_remote_reduction_equals_in_process_engine(
    client: GradientClient, engine: Engine, reduction: str, options: dict, fields: list[str]
) -> None:
    x, y = _batch()
    remote = client.per_example_gradients("mnist_cnn", x, y, reduction=reduction, **options)
    local = engine.per_example_gradients(x, y, reduction=reduction, **options)
    assert remote.gradients == {} and remote.model_version == 1
    assert_close({"losses": remote.losses}, {"losses": local.losses})
    for name in fields:
        got, want = getattr(remote, name), getattr(local, name)
        if isinstance(want, dict):
            assert_close(got, want)
        elif isinstance(want, int):
            assert got == want
        else:
            assert_close({name: got}, {name: want})


def test_remote_norms_and_clipped_sum_match_keras_oracle(client: GradientClient) -> None:
    """The bound lies between the median oracle norm and the next: the larger half clipped."""
    x, y = _batch()
    _, grads = oracle.per_example(BUILTIN_MODELS["mnist_cnn"](), LOSS, x, y)
    norms = oracle.per_example_norms(grads)
    middle = len(norms) // 2
    max_norm = float(np.mean(np.sort(norms)[middle : middle + 2]))
    remote = client.per_example_gradients(
        "mnist_cnn", x, y, reduction="clipped_sum", max_norm=max_norm
    )
    assert remote.num_clipped == int(np.sum(norms > max_norm)) == len(x) // 2
    assert_close({"norms": remote.norms}, {"norms": norms})
    assert_close(remote.clipped_sum, oracle.clipped_sum(grads, max_norm))


def test_remote_dot_with_reference_gradients(client: GradientClient, engine: Engine) -> None:
    x, y = _batch()
    rng = np.random.default_rng(0)
    reference = {
        v.path: rng.standard_normal((4, *v.shape)) for v in engine.model.trainable_variables
    }
    remote = client.per_example_gradients("mnist_cnn", x, y, reduction="dot", reference=reference)
    local = engine.per_example_gradients(x, y, reduction="dot", reference=reference)
    assert remote.dots.shape == (9, 4)
    assert_close({"dots": remote.dots}, {"dots": local.dots})


def test_remote_noise_is_the_same_bytes_for_the_same_seed(client: GradientClient) -> None:
    x, y = _batch()
    options = {"reduction": "clipped_sum", "max_norm": 0.1, "noise_multiplier": 1.0, "seed": 11}
    first = client.per_example_gradients("mnist_cnn", x, y, **options)
    second = client.per_example_gradients("mnist_cnn", x, y, **options)
    for name, value in first.clipped_sum.items():
        assert value.tobytes() == second.clipped_sum[name].tobytes()


def test_variables_filter_returns_only_those_gradients(client: GradientClient) -> None:
    x, y = _batch(3)
    result = client.per_example_gradients("mnist_cnn", x, y, variables=["logits/kernel"])
    assert list(result.gradients) == ["logits/kernel"]
    assert result.gradients["logits/kernel"].shape == (3, 32, 10)


def test_stream_carries_the_reduction(client: GradientClient) -> None:
    batches = [_batch(size) for size in (2, 5)]
    results = list(client.stream("mnist_cnn", batches, reduction="norms"))
    assert [r.norms.shape for r in results] == [(2,), (5,)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduction": "clipped_sum"}, "max_norm: clipped_sum needs a finite positive bound"),
        ({"reduction": "norms", "dim": 3}, "['dim']: not options of reduction 'norms'"),
        ({"variables": ["conv9/kernel"]}, "variables: unknown ['conv9/kernel']"),
        ({"reduction": "dot", "reference": {"logits/bias": np.zeros((2, 10))}}, "missing"),
    ],
)
def test_bad_reduction_requests_are_invalid_arguments(
    client: GradientClient, kwargs: dict, message: str
) -> None:
    x, y = _batch(2)
    with pytest.raises(PergradError) as err:
        client.per_example_gradients("mnist_cnn", x, y, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message


def test_unknown_reduction_is_refused_by_the_client(client: GradientClient) -> None:
    x, y = _batch(2)
    with pytest.raises(PergradError, match="reduction: unknown 'median'"):
        client.per_example_gradients("mnist_cnn", x, y, reduction="median")


# Float32's largest finite value and the half ulp past it: float64 magnitudes from there
# round to infinity in float32.
FLOAT32_OVERFLOWS = (2 - 2**-24) * 2.0**127


def _raw_dots(client: GradientClient, x, y, reference: dict[str, np.ndarray]) -> np.ndarray:
    """`dot` of a request sent raw, its references in their own dtypes (the client would
    send float32), read from the result inlined in its header."""
    request = pb.GradientsRequest(
        model="mnist_mlp",
        inputs=encode_tensor(x),
        labels=encode_tensor(y),
        reduction=pb.REDUCTION_DOT,
        inline_result=True,
    )
    for name, array in reference.items():
        request.reference[name].CopyFrom(encode_tensor(array))
    with grpc.insecure_channel(client.replicas[0]) as channel:
        (reply,) = channel.unary_stream(
            "/pergrad.v1.GradientService/ComputePerExampleGradients",
            request_serializer=pb.GradientsRequest.SerializeToString,
            response_deserializer=pb.GradientsResponse.FromString,
        )(request, timeout=60)
    arrays, start = {}, 0
    for output in reply.header.outputs:
        dtype, shape = numpy_dtype(output.tensor.dtype), tuple(output.tensor.shape)
        size = int(np.prod(shape)) * dtype.itemsize
        arrays[output.field] = np.frombuffer(reply.header.data[start : start + size], dtype)
        arrays[output.field] = arrays[output.field].reshape(shape)
        start += size
    return arrays["dots"]


def _references(dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"hidden/kernel": (784, 128), "hidden/bias": (128,)}
    shapes |= {"logits/kernel": (128, 10), "logits/bias": (10,)}
    if dtype == "bool":
        return {name: rng.random((2, *shape)) < 0.5 for name, shape in shapes.items()}
    if dtype in ("uint8", "int32", "int64"):
        low = 0 if dtype == "uint8" else -1000
        return {
            name: rng.integers(low, 256, (2, *shape)).astype(dtype)
            for name, shape in shapes.items()
        }
    wanted = dtype_named(dtype)
    return {name: rng.standard_normal((2, *shape)).astype(wanted) for name, shape in shapes.items()}


@pytest.mark.parametrize(
    "dtype", ["float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool"]
)
def test_dot_takes_references_of_every_dtype_as_their_float32_values(
    client: GradientClient, dtype: str
) -> None:
    """GradientsRequest.reference: any DataType, BOOL as 1 and 0, each value rounded to
    float32: the dots are those of the same references sent as float32."""
    x, y = batch_for((784,), 10, 3)
    reference = _references(dtype)
    as_float32 = {name: array.astype(np.float32) for name, array in reference.items()}
    want = client.per_example_gradients("mnist_mlp", x, y, reduction="dot", reference=as_float32)
    np.testing.assert_array_equal(_raw_dots(client, x, y.astype(np.int32), reference), want.dots)


def test_a_float64_reference_past_float32s_range_is_invalid(client: GradientClient) -> None:
    """A FLOAT64 value of magnitude (2 - 2^-24) * 2^127, which rounds to infinity in
    float32, is INVALID_ARGUMENT; the float64 just below it (float32's largest, once
    rounded) is taken."""
    x, y = batch_for((784,), 10, 3)
    reference = {name: np.zeros_like(a, np.float64) for name, a in _references("float32").items()}
    for value, taken in [(np.nextafter(FLOAT32_OVERFLOWS, 0), True), (FLOAT32_OVERFLOWS, False)]:
        reference["logits/bias"][0, 0] = -value
        if taken:
            assert np.isfinite(_raw_dots(client, x, y.astype(np.int32), reference)).all()
            continue
        with pytest.raises(grpc.RpcError) as err:
            _raw_dots(client, x, y.astype(np.int32), reference)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "reference['logits/bias']: values outside the range of float32" in err.value.details()
        )
