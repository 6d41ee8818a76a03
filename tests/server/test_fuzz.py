"""Random, malformed, truncated and resource-shaped requests, and idle streams, against a
live server: every answer is a deliberate status (never UNKNOWN or INTERNAL), and the
server stays healthy and answering.

`PERGRAD_FUZZ_EXAMPLES` sets how many requests of each kind (`make soak` runs thousands).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pergrad.server.main import RunningServer, start
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.codec import encode_tensor
from pergrad.wire.results import expected_outputs
from tests.helpers import loopback_config

EXAMPLES = int(os.environ.get("PERGRAD_FUZZ_EXAMPLES", "150"))
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SERVICE = "/pergrad.v1.GradientService/"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

dims = st.lists(st.integers(-2, 900), max_size=4)
tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.integers(0, 12),
    shape=dims,
    content=st.binary(max_size=4096),
)
# Sometimes a tensor that is right for mnist_mlp, so the checks past decoding run too.
good_inputs = st.integers(1, 4).map(
    lambda b: tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[b, 784], content=b"\0" * (b * 784 * 4)
    )
)
requests = st.builds(
    pb.GradientsRequest,
    model=st.sampled_from(["mnist_mlp", "mnist_cnn", "", "nope", "../x"]),
    model_version=st.integers(-3, 3),
    inputs=st.one_of(tensors, good_inputs),
    labels=tensors,
    reduction=st.integers(0, 7),
    variables=st.lists(st.sampled_from(["hidden/bias", "logits/kernel", "zz"]), max_size=3),
    max_norm=st.floats(allow_nan=True, allow_infinity=True),
    dim=st.integers(0, 1 << 20),
    wire_dtype=st.integers(0, 12),
)


def _call(server: RunningServer, method: str, payload, *, streaming_request: bool = False):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        if streaming_request:
            call = channel.stream_unary(SERVICE + method)
            return call(iter(payload), timeout=30)
        call = channel.unary_stream(SERVICE + method)
        return list(call(payload, timeout=30))


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@FUZZ
@given(request=requests)
def test_random_gradient_requests_get_deliberate_codes(server: RunningServer, request) -> None:
    code = _code(lambda: _call(server, "ComputePerExampleGradients", request.SerializeToString()))
    assert code not in BAD_CODES


@FUZZ
@given(data=st.binary(max_size=2048))
def test_garbage_bytes_get_deliberate_codes(server: RunningServer, data: bytes) -> None:
    code = _code(lambda: _call(server, "ComputePerExampleGradients", data))
    assert code not in BAD_CODES


@FUZZ
@given(request=requests, cut=st.integers(0, 2000))
def test_truncated_requests_get_deliberate_codes(server: RunningServer, request, cut) -> None:
    data = request.SerializeToString()
    code = _code(lambda: _call(server, "ComputePerExampleGradients", data[: min(cut, len(data))]))
    assert code not in BAD_CODES


weights_messages = st.lists(
    st.one_of(
        st.builds(
            pb.WeightsMessage,
            header=st.builds(
                pb.WeightsHeader,
                model=st.sampled_from(["mnist_cnn", "x"]),
                model_version=st.integers(-1, 3),
                tensors=st.lists(
                    st.builds(
                        tensor_pb2.TensorSpec,
                        name=st.text(max_size=12),
                        dtype=st.integers(0, 9),
                        shape=dims,
                    ),
                    max_size=3,
                ),
            ),
        ),
        st.builds(
            pb.WeightsMessage,
            chunk=st.builds(
                tensor_pb2.TensorChunk,
                tensor=st.integers(0, 9),
                offset=st.integers(0, 1 << 40),
                data=st.binary(max_size=512),
            ),
        ),
    ),
    max_size=5,
).map(lambda messages: [m.SerializeToString() for m in messages])


@FUZZ
@given(messages=st.one_of(weights_messages, st.lists(st.binary(max_size=64), max_size=3)))
def test_random_set_weights_streams_get_deliberate_codes(server: RunningServer, messages) -> None:
    code = _code(lambda: _call(server, "SetWeights", messages, streaming_request=True))
    assert code not in BAD_CODES


def test_server_is_serving_after_the_fuzzing(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# Resource-shaped requests: many reference rows, large projections, a new seed every time,
# all on a small variable so each stays cheap to compute when it is admitted.
resource_requests = st.builds(
    lambda reduction, batch, k, dim, seed: _resource_request(reduction, batch, k, dim, seed),
    reduction=st.sampled_from(["dot", "project", "clipped_sum"]),
    batch=st.integers(1, 64),
    k=st.integers(1, 200_000),
    dim=st.integers(1, 1 << 17),
    seed=st.integers(0, 2**64 - 1),
)


def _resource_request(reduction: str, batch: int, k: int, dim: int, seed: int):
    x = np.zeros((batch, 784), np.float32)
    request = pb.GradientsRequest(
        model="mnist_mlp",
        inputs=encode_tensor(x),
        labels=encode_tensor(np.zeros(batch, np.int32)),
        reduction=pb.Reduction.Value(f"REDUCTION_{reduction.upper()}"),
        variables=["logits/bias"],
    )
    if reduction == "dot":
        request.reference["logits/bias"].CopyFrom(encode_tensor(np.ones((k, 10), np.float32)))
    elif reduction == "project":
        request.dim, request.seed = dim, seed
    else:
        request.max_norm, request.noise_multiplier, request.seed = 1.0, 1.0, seed
    expected = expected_outputs(
        CATALOGUE.get(reduction),
        batch=batch,
        variables=[("logits/bias", (10,))],
        options={"reference": {"logits/bias": np.zeros((k, 10))}, "dim": dim},
    )
    return request, [(e.field, e.variable, e.shape) for e in expected]


@FUZZ
@given(case=resource_requests)
def test_resource_shaped_requests_get_deliberate_codes(server: RunningServer, case) -> None:
    request, expected = case
    result = []
    data = request.SerializeToString()
    code = _code(lambda: result.extend(_call(server, "ComputePerExampleGradients", data)))
    assert code not in BAD_CODES
    if code == grpc.StatusCode.OK:
        header = pb.GradientsResponse.FromString(result[0]).header
        got = [(o.field, o.tensor.name, tuple(o.tensor.shape)) for o in header.outputs]
        assert got == expected


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[RunningServer]:
    running = start(loopback_config("mnist_mlp", workers=3, max_streams=2, stall_timeout_s=1.0))
    yield running
    running.stop(0)


STREAM_METHODS = [
    SERVICE + "StreamPerExampleGradients",
    SERVICE + "SetWeights",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.health.v1.Health/Watch",
]


@settings(
    max_examples=max(5, EXAMPLES // 15), deadline=None, suppress_health_check=list(HealthCheck)
)
@given(methods=st.lists(st.sampled_from(STREAM_METHODS), min_size=1, max_size=12))
def test_idle_streams_of_any_kind_leave_the_server_answering(guarded_server, methods) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{guarded_server.port}") as channel:
        never = threading.Event()

        def nothing() -> Iterator[bytes]:
            never.wait()
            yield b""

        opened = [
            channel.unary_stream(m)(health_pb2.HealthCheckRequest().SerializeToString())
            if m.endswith("Watch")
            else channel.stream_stream(m)(nothing())
            for m in methods
        ]
        reply = channel.unary_unary(SERVICE + "ListModels")(
            pb.ListModelsRequest().SerializeToString(), timeout=10
        )
        assert pb.ListModelsResponse.FromString(reply).models == ["mnist_mlp"]
        never.set()
        for call in opened:
            call.cancel()
