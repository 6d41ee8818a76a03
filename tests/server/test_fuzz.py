"""Random, malformed and truncated requests against a live server: every answer is a
deliberate status (never UNKNOWN or INTERNAL), and the server stays healthy.

`PERGRAD_FUZZ_EXAMPLES` sets how many requests of each kind (`make soak` runs thousands).
"""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pergrad.server.main import RunningServer
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2

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
