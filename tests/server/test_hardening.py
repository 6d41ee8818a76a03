"""Bad, hostile and racing requests against a real server: precise codes, nothing changed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.v1 import tensor_pb2
from pergrad.wire.codec import encode_tensor, iter_chunks, tensor_spec
from tests import oracle
from tests.helpers import assert_close, batch_for, loopback_config


@pytest.fixture()
def small_server(tmp_path: Path) -> Iterator[RunningServer]:
    """mnist_mlp with tight limits: 1 MiB requests, 40 examples or 8 MB of results at once."""
    running = start(
        loopback_config(
            "mnist_mlp",
            max_request_bytes=1 << 20,
            max_inflight_examples=40,
            max_inflight_bytes=8_000_000,
        )
    )
    yield running
    running.stop(0)


def _target(server: RunningServer) -> str:
    return f"127.0.0.1:{server.port}"


def _serving(server: RunningServer) -> bool:
    with grpc.insecure_channel(_target(server)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_batch_over_the_inflight_examples_is_refused_at_once(small_server) -> None:
    with GradientClient(_target(small_server)) as client:
        x, y = batch_for((784,), 10, 41)
        with pytest.raises(PergradError) as err:
            client.per_example_gradients("mnist_mlp", x, y, reduction="norms")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inflight-examples" in err.value.message
        assert client.per_example_gradients("mnist_mlp", x[:40], y[:40], reduction="norms")


def test_result_over_the_inflight_bytes_is_refused_at_once(small_server) -> None:
    with GradientClient(_target(small_server)) as client:
        x, y = batch_for((784,), 10, 20)  # 20 x 407 KB of gradients > 8 MB
        with pytest.raises(PergradError) as err:
            client.per_example_gradients("mnist_mlp", x, y)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.per_example_gradients("mnist_mlp", x[:19], y[:19]).batch_size == 19


def test_request_over_the_message_limit_is_resource_exhausted(small_server) -> None:
    """Sent whole (the client would split it): gRPC refuses it unread."""
    x, y = batch_for((784,), 10, 400)  # 1.25 MB of inputs
    request = pb.GradientsRequest(model="mnist_mlp", inputs=_tensor(x), labels=_tensor(y))
    with grpc.insecure_channel(_target(small_server)) as channel:
        call = channel.unary_stream("/pergrad.v1.GradientService/ComputePerExampleGradients")
        with pytest.raises(grpc.RpcError) as err:
            list(call(request.SerializeToString(), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _serving(small_server)


def test_non_finite_inputs_are_refused_naming_the_examples(small_server) -> None:
    x, y = batch_for((784,), 10, 6)
    x[2, 5], x[4, 0] = np.nan, np.inf
    with GradientClient(_target(small_server)) as client, pytest.raises(PergradError) as err:
        client.per_example_gradients("mnist_mlp", x, y)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs: examples [2, 4] hold NaN or infinity" in err.value.message


def _set_weights_raw(server: RunningServer, messages: list[pb.WeightsMessage]) -> grpc.RpcError:
    with grpc.insecure_channel(_target(server)) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.GradientServiceStub(channel).SetWeights(iter(messages), timeout=30)
    return err.value


def _weights_messages(weights: dict[str, np.ndarray], order=None, names=None) -> list:
    arrays = list(weights.values())
    specs = [tensor_spec(n, a) for n, a in zip(names or weights, arrays, strict=True)]
    chunks = [c for i, a in enumerate(arrays) for c in iter_chunks(i, a, chunk_bytes=65536)]
    chunks = [chunks[i] for i in (order or range(len(chunks)))]
    header = pb.WeightsHeader(model="mnist_mlp", tensors=specs)
    return [pb.WeightsMessage(header=header), *(pb.WeightsMessage(chunk=c) for c in chunks)]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("duplicated", "duplicated ['hidden/bias']"),
        ("out_of_order", "out of order"),
        ("truncated", "truncated"),
        ("no_header", "the first message must be a WeightsHeader"),
    ],
)
def test_malformed_set_weights_changes_nothing(small_server, case: str, message: str) -> None:
    with GradientClient(_target(small_server)) as client:
        version, weights = client.get_weights("mnist_mlp")
    if case == "duplicated":
        names = ["hidden/kernel", "hidden/bias", "hidden/bias", "logits/bias"]
        messages = _weights_messages(weights, names=names)
    elif case == "out_of_order":
        count = len(_weights_messages(weights)) - 1
        messages = _weights_messages(weights, order=[1, 0, *range(2, count)])
    elif case == "truncated":
        messages = _weights_messages(weights)[:-3]
    else:
        messages = _weights_messages(weights)[1:]
    error = _set_weights_raw(small_server, messages)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    with GradientClient(_target(small_server)) as client:
        assert client.get_weights("mnist_mlp")[0] == version


def test_set_weights_racing_gradient_requests_never_tears(fresh_server) -> None:
    """Every response equals the oracle's for exactly the weights version it reports (on
    a server of default bounds: the four readers share one connection, so one caller,
    whose calls may hold half of --max-inflight-bytes, which small_server's 8 MB is not)."""
    x, y = batch_for((784,), 10, 3, seed=4)
    with GradientClient(_target(fresh_server)) as client:
        base_version, base = client.get_weights("mnist_mlp")
    versions = {base_version: base}
    for k in range(1, 9):
        versions[base_version + k] = {n: w * (1 + 0.25 * k) for n, w in base.items()}
    model = BUILTIN_MODELS["mnist_mlp"]()
    expected = {v: oracle.per_example(model, LOSS, x, y, weights=w)[1] for v, w in versions.items()}
    seen, failures = [], []

    def reader() -> None:
        with GradientClient(_target(fresh_server)) as client:
            for _ in range(25):
                try:
                    seen.append(client.per_example_gradients("mnist_mlp", x, y))
                except PergradError as err:
                    failures.append(err)

    def writer() -> None:
        with GradientClient(_target(fresh_server)) as client:
            for k in range(1, 9):
                client.set_weights("mnist_mlp", versions[base_version + k])

    threads = [threading.Thread(target=reader) for _ in range(4)] + [
        threading.Thread(target=writer)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures[:3]
    assert len(seen) == 100
    assert len({r.model_version for r in seen}) >= 2
    for result in seen:
        assert_close(result.gradients, expected[result.model_version])


def _tensor(array: np.ndarray, *, shape=None, content=None, dtype=None) -> tensor_pb2.Tensor:
    tensor = encode_tensor(array)
    if shape is not None:
        del tensor.shape[:]
        tensor.shape.extend(shape)
    if content is not None:
        tensor.content = content
    if dtype is not None:
        tensor.dtype = dtype
    return tensor


_X = np.zeros((2, 784), np.float32)
_DOT = {"reduction": pb.REDUCTION_DOT, "variables": ["logits/bias"]}
_NAN_REFERENCE = np.full((1, 10), np.nan, np.float32)
_HUGE_REFERENCE = np.full((1, 10), 1e300)
_Y = np.zeros(2, np.int32)
BAD_REQUESTS = {
    "inputs rank": (dict(inputs=_tensor(np.zeros(784, np.float32))), "INVALID_ARGUMENT", "inputs"),
    "inputs shape": (
        dict(inputs=_tensor(np.zeros((2, 783), np.float32))),
        "INVALID_ARGUMENT",
        "inputs: shape [2, 783]",
    ),
    "inputs dtype": (
        dict(inputs=_tensor(np.zeros((2, 784), np.int32))),
        "INVALID_ARGUMENT",
        "inputs: dtype int32",
    ),
    "labels rank": (
        dict(labels=_tensor(np.zeros((2, 1), np.int32))),
        "INVALID_ARGUMENT",
        "labels: shape [2, 1]",
    ),
    "labels dtype": (
        dict(labels=_tensor(np.zeros(2, np.float32))),
        "INVALID_ARGUMENT",
        "labels: dtype float32",
    ),
    "different B": (
        dict(labels=_tensor(np.zeros(3, np.int32))),
        "INVALID_ARGUMENT",
        "labels: shape [3]",
    ),
    "empty batch": (
        dict(inputs=_tensor(np.zeros((0, 784), np.float32)), labels=_tensor(np.zeros(0, np.int32))),
        "INVALID_ARGUMENT",
        "empty batch",
    ),
    "over max batch": (
        dict(inputs=_tensor(_X, shape=[5000, 784], content=b"")),
        "RESOURCE_EXHAUSTED",
        "exceeds --max-batch",
    ),
    "bytes vs shape": (
        dict(inputs=_tensor(_X, content=b"\0" * 10)),
        "INVALID_ARGUMENT",
        "inputs: float32 [2, 784] needs 6272 bytes, got 10",
    ),
    "unknown dtype": (
        dict(inputs=_tensor(_X, dtype=42)),
        "INVALID_ARGUMENT",
        "unsupported dtype 42",
    ),
    "non-finite": (
        dict(inputs=_tensor(np.full((2, 784), np.nan, np.float32))),
        "INVALID_ARGUMENT",
        "NaN or infinity",
    ),
    "label range": (
        dict(labels=_tensor(np.array([0, 12], np.int32))),
        "INVALID_ARGUMENT",
        "class index 12",
    ),
    "dot reference NaN": (
        dict(_DOT, reference={"logits/bias": _tensor(_NAN_REFERENCE)}),
        "INVALID_ARGUMENT",
        "reference['logits/bias']: holds NaN or infinity",
    ),
    "dot reference scalar": (
        dict(_DOT, reference={"logits/bias": _tensor(np.ones(1, np.float32), shape=[])}),
        "INVALID_ARGUMENT",
        "reference['logits/bias']: a [K, *shape] tensor, got a scalar",
    ),
    "dot reference beyond float32": (
        dict(_DOT, reference={"logits/bias": _tensor(_HUGE_REFERENCE)}),
        "INVALID_ARGUMENT",
        "reference['logits/bias']: values outside the range of float32",
    ),
    "unknown model": (dict(model="resnet"), "NOT_FOUND", "model 'resnet' not found"),
    "unknown variable": (
        dict(variables=["hidden/nope"]),
        "INVALID_ARGUMENT",
        "variables: unknown ['hidden/nope']",
    ),
    "stale pin": (dict(model_version=99), "FAILED_PRECONDITION", "model_version 99"),
    "unknown reduction": (dict(reduction=17), "INVALID_ARGUMENT", "reduction: unknown value 17"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_table(small_server, case: str) -> None:
    """Each row: the expected code, a message naming the field, the server still healthy
    and the weights unchanged."""
    fields, code, message = BAD_REQUESTS[case]
    request = pb.GradientsRequest(
        **{"model": "mnist_mlp", "inputs": _tensor(_X), "labels": _tensor(_Y), **fields}
    )
    with GradientClient(_target(small_server)) as client:
        version = client.get_weights("mnist_mlp")[0]
    with grpc.insecure_channel(_target(small_server)) as channel:
        call = channel.unary_stream("/pergrad.v1.GradientService/ComputePerExampleGradients")
        with pytest.raises(grpc.RpcError) as err:
            list(call(request.SerializeToString(), timeout=30))
    assert err.value.code().name == code
    assert message in err.value.details()
    assert _serving(small_server)
    with GradientClient(_target(small_server)) as client:
        assert client.get_weights("mnist_mlp")[0] == version
