"""The client against a real gRPC server that answers wrongly: every fault is a
PergradError (DATA_LOSS), found before anything the server declares is allocated."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunks import encode_chunk
from pergrad.wire.rpc import SERVICE_NAME

F32 = tensor_pb2.DATA_TYPE_FLOAT32
INFO = pb.ModelInfo(
    name="m",
    model_version=1,
    variables=[tensor_pb2.TensorSpec(name="w", dtype=F32, shape=[3, 2])],
    input=tensor_pb2.TensorSpec(name="input", dtype=F32, shape=[-1, 3]),
    labels=tensor_pb2.TensorSpec(name="labels", dtype=F32, shape=[-1, 2]),
    loss="mean_squared_error()",
)


def _header(batch: int, grad_shape: list[int]) -> pb.GradientsResponse:
    return pb.GradientsResponse(
        header=pb.ResultHeader(
            model="m",
            model_version=1,
            batch_size=batch,
            outputs=[
                pb.ResultTensor(
                    field="losses", tensor=tensor_pb2.TensorSpec(dtype=F32, shape=[batch])
                ),
                pb.ResultTensor(
                    field="gradients",
                    tensor=tensor_pb2.TensorSpec(name="w", dtype=F32, shape=grad_shape),
                ),
            ],
        )
    )


def _full(batch: int) -> list[bytes]:
    """A correct result for `batch` examples."""
    losses, grads = np.zeros(batch, np.float32), np.zeros((batch, 3, 2), np.float32)
    return [
        _header(batch, [batch, 3, 2]).SerializeToString(),
        encode_chunk(0, 0, 0, memoryview(losses.tobytes())),
        encode_chunk(0, 1, 0, memoryview(grads.tobytes())),
    ]


ANSWERS: dict[str, Callable[[int], list[bytes]]] = {
    "fewer rows": lambda b: _full(1),
    "two gigabytes": lambda b: [_header(b, [b, 2**28, 2]).SerializeToString()],
    "other field": lambda b: [
        pb.GradientsResponse(
            header=pb.ResultHeader(
                batch_size=b,
                outputs=[
                    pb.ResultTensor(
                        field="losses", tensor=tensor_pb2.TensorSpec(dtype=F32, shape=[b])
                    ),
                    pb.ResultTensor(
                        field="norms", tensor=tensor_pb2.TensorSpec(dtype=F32, shape=[b])
                    ),
                ],
            )
        ).SerializeToString()
    ],
    "garbage": lambda b: [b"\xff\xff\xff\xff"],
    "chunk past the end": lambda b: [*_full(b)[:2], encode_chunk(0, 1, 10**6, memoryview(b"x"))],
    "truncated": lambda b: _full(b)[:2],
    "chunk before header": lambda b: [encode_chunk(0, 0, 0, memoryview(b"\0" * 4))],
}


def _info(**variable: object) -> bytes:
    """INFO with its one variable changed."""
    info = pb.ModelInfo()
    info.CopyFrom(INFO)
    del info.variables[:]
    info.variables.append(tensor_pb2.TensorSpec(**{"name": "w", "dtype": F32, **variable}))
    return info.SerializeToString()


def _weights_header(shape: list[int], dtype: int = F32) -> bytes:
    header = pb.WeightsHeader(
        model="m", tensors=[tensor_pb2.TensorSpec(name="w", dtype=dtype, shape=shape)]
    )
    return pb.WeightsMessage(header=header).SerializeToString()


def _weights_chunk(offset: int, data: bytes) -> bytes:
    chunk = tensor_pb2.TensorChunk(tensor=0, offset=offset, data=data)
    return pb.WeightsMessage(chunk=chunk).SerializeToString()


# Answers to GetModelInfo no client may believe: each is DATA_LOSS before any allocation.
INFOS: dict[str, bytes] = {
    "garbage": b"\xff\xff\xff\xff",
    "unknown dtype": _info(dtype=999, shape=[3, 2]),
    "negative dimension": _info(dtype=F32, shape=[-1, 2]),
    "rank beyond the codec's": _info(dtype=F32, shape=[1] * 40),
    "four tebibytes of variables": _info(dtype=F32, shape=[2**20, 2**20]),
}

# Answers to GetWeights for INFO's variable "w" [3, 2] float32, each malformed.
WEIGHTS: dict[str, list[bytes]] = {
    "two gigabytes": [_weights_header([2**30, 2])],
    "nothing": [],
    "garbage": [b"\xff\xff\xff\xff"],
    "chunk first": [_weights_chunk(0, b"\0" * 24)],
    "unknown dtype": [_weights_header([3, 2], dtype=999)],
    "two headers": [_weights_header([3, 2]), _weights_header([3, 2])],
    "chunk past the end": [_weights_header([3, 2]), _weights_chunk(0, b"\0" * 25)],
    "out of order": [_weights_header([3, 2]), _weights_chunk(8, b"\0" * 16)],
    "truncated": [_weights_header([3, 2]), _weights_chunk(0, b"\0" * 20)],
}


class _Hostile:
    answer = "fewer rows"
    info = INFO.SerializeToString()
    weights_answer = "two gigabytes"

    def handlers(self) -> grpc.GenericRpcHandler:
        def info(request: bytes, context) -> bytes:
            return self.info

        def compute(request: bytes, context) -> Iterator[bytes]:
            batch = pb.GradientsRequest.FromString(request).inputs.shape[0]
            yield from ANSWERS[self.answer](batch)

        def weights(request: bytes, context) -> Iterator[bytes]:
            yield from WEIGHTS[self.weights_answer]

        identity = {"request_deserializer": None, "response_serializer": None}
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(info, **identity),
                "ComputePerExampleGradients": grpc.unary_stream_rpc_method_handler(
                    compute, **identity
                ),
                "GetWeights": grpc.unary_stream_rpc_method_handler(weights, **identity),
            },
        )


@pytest.fixture(scope="module")
def hostile() -> Iterator[tuple[_Hostile, str]]:
    from concurrent import futures

    state = _Hostile()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((state.handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield state, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_a_wrong_answer_is_data_loss(hostile, answer: str) -> None:
    state, target = hostile
    state.answer = answer
    x, y = np.zeros((4, 3)), np.zeros((4, 2))
    started = time.perf_counter()
    with GradientClient(target) as client, pytest.raises(PergradError) as err:
        client.per_example_gradients("m", x, y)
    assert err.value.code == grpc.StatusCode.DATA_LOSS, err.value
    assert time.perf_counter() - started < 10  # nothing large was allocated or filled


def test_micro_batches_that_lose_rows_are_data_loss(hostile) -> None:
    state, target = hostile
    state.answer = "fewer rows"
    with GradientClient(target, micro_batch=2) as client, pytest.raises(PergradError) as err:
        client.per_example_gradients("m", np.zeros((4, 3)), np.zeros((4, 2)))
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_weights_that_are_not_the_models_are_data_loss(hostile) -> None:
    _, target = hostile
    with GradientClient(target) as client, pytest.raises(PergradError) as err:
        client.get_weights("m")
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert "do not match the model's variables" in err.value.message


@pytest.mark.parametrize("answer", sorted(WEIGHTS))
def test_every_malformed_weights_answer_is_data_loss(hostile, monkeypatch, answer: str) -> None:
    state, target = hostile
    monkeypatch.setattr(state, "weights_answer", answer)
    started = time.perf_counter()
    with GradientClient(target) as client, pytest.raises(PergradError) as err:
        client.get_weights("m")
    assert err.value.code == grpc.StatusCode.DATA_LOSS, err.value
    assert err.value.message.startswith("weights of 'm': ")
    assert time.perf_counter() - started < 10  # nothing large was allocated or filled


@pytest.mark.parametrize("info", sorted(INFOS))
def test_a_model_info_no_client_may_believe_is_data_loss_for_every_call(
    hostile, monkeypatch, info: str
) -> None:
    """model_info, and what trusts it: weights and full gradients would allocate what its
    variables declare."""
    state, target = hostile
    monkeypatch.setattr(state, "info", INFOS[info])
    started = time.perf_counter()
    with GradientClient(target) as client:
        for call in (
            lambda: client.model_info("m"),
            lambda: client.get_weights("m"),
            lambda: client.per_example_gradients("m", np.zeros((4, 3)), np.zeros((4, 2))),
        ):
            with pytest.raises(PergradError) as err:
                call()
            assert err.value.code == grpc.StatusCode.DATA_LOSS, err.value
            assert err.value.message.startswith("model info of 'm': "), err.value
    assert time.perf_counter() - started < 10


def test_variables_beyond_max_model_bytes_are_refused_and_within_it_believed(hostile) -> None:
    _, target = hostile
    with GradientClient(target, max_model_bytes=23) as client, pytest.raises(PergradError) as err:
        client.model_info("m")  # "w" [3, 2] float32: 24 bytes
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert "max_model_bytes (23)" in err.value.message
    with GradientClient(target, max_model_bytes=24) as client:
        assert client.model_info("m").num_parameters == 6
