"""Chunked requests against a live server, sent raw as a client of the contract would:
answered as the same request in one message, their size refused and held from the first
message before any chunk is read, their chunks checked and timed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient
from pergrad.server.main import RunningServer, start
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunked_requests import (
    MESSAGE_BYTES,
    MIN_CHUNK_BYTES,
    in_chunks,
    tensor_keys,
)
from pergrad.wire.codec import encode_tensor
from pergrad.wire.messages import gradients_request
from tests.helpers import batch_for, loopback_config

SERVICE = "/pergrad.v1.GradientService/"
KIB = 1 << 10


@pytest.fixture(scope="module")
def running() -> Iterator[RunningServer]:
    """mnist_mlp; stalls cancelled after two seconds."""
    server = start(loopback_config("mnist_mlp", max_batch=2048, stall_timeout_s=2.0))
    yield server
    server.stop(0)


@pytest.fixture()
def channel(running: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as opened:
        yield opened


def _norms_request(batch: int, request_id: int = 0) -> pb.GradientsRequest:
    x, y = batch_for((784,), 10, batch)
    norms = CATALOGUE.get("norms")
    request = gradients_request(
        "mnist_mlp", x, y, reduction=norms, options={}, request_id=request_id
    )
    return request.inline()


def _call(channel: grpc.Channel, method: str, messages: Iterator, timeout: float = 60) -> list:
    """A method's raw responses to these messages (ApplyStep's one reply in a list)."""
    serialized = (m if isinstance(m, bytes) else m.SerializeToString() for m in messages)
    if method == "ApplyStep":
        return [channel.stream_unary(SERVICE + method)(serialized, timeout=timeout)]
    return list(channel.stream_stream(SERVICE + method)(serialized, timeout=timeout))


def _refusal(channel: grpc.Channel, messages: Iterator, method: str = "ComputePerExampleGradients"):
    with pytest.raises(grpc.RpcError) as refused:
        _call(channel, method, messages, timeout=30)
    return refused.value


def _then_silence(messages: list, until: threading.Event) -> Iterator:
    """The messages, then a stream that stays open until `until` (the call ended)."""
    yield from messages
    until.wait(30)


def test_a_request_in_chunks_is_answered_as_the_same_request_in_one_message(
    channel: grpc.Channel,
) -> None:
    request = _norms_request(512)  # 1.6 MB: within one message too
    parts = in_chunks(request, inline_bytes=64 * KIB, chunk_bytes=100 * KIB)
    assert len(parts) > 10
    method = "ComputePerExampleGradients"
    assert _call(channel, method, iter(parts)) == _call(channel, method, iter([request]))


def test_a_stream_reads_each_request_with_its_chunks(channel: grpc.Channel) -> None:
    large, small = _norms_request(512, request_id=1), _norms_request(3, request_id=2)
    messages = [*in_chunks(large, inline_bytes=KIB), small]
    responses = _call(channel, "StreamPerExampleGradients", iter(messages))
    alone = _call(channel, "ComputePerExampleGradients", iter([large]))
    assert responses[: len(alone)] == alone


def test_a_step_applies_a_batch_sent_in_chunks(channel: grpc.Channel) -> None:
    step = pb.StepRequest(model="mnist_mlp", learning_rate=0.1, batch=_norms_request(512))
    step.batch.model = ""
    step.batch.reduction = pb.REDUCTION_MOMENTS
    (reply,) = _call(channel, "ApplyStep", iter(in_chunks(step, inline_bytes=KIB)))
    assert pb.StepResponse.FromString(reply).losses.shape == [512]


def test_a_step_applies_a_gradient_sum_sent_in_chunks_bit_for_bit(
    running: RunningServer, channel: grpc.Channel
) -> None:
    """The sum's chunked tensors reach the optimizer as sent: SGD's new weights are the
    old ones less lr * sum / expected_batch_size, computed in float32 as the server does."""
    with GradientClient(f"127.0.0.1:{running.port}") as client:
        version, before = client.get_weights("mnist_mlp")
        rng = np.random.default_rng(0)
        sums = {n: rng.standard_normal(w.shape).astype(np.float32) for n, w in before.items()}
        step = pb.StepRequest(
            model="mnist_mlp", model_version=version, learning_rate=0.5, expected_batch_size=4
        )
        for name, total in sums.items():
            step.gradient_sum[name].CopyFrom(encode_tensor(total))
        parts = in_chunks(step, inline_bytes=KIB)
        assert sum(tensor.chunked for _, tensor in tensor_keys(parts[0])) == 2
        _call(channel, "ApplyStep", iter(parts))
        _, after = client.get_weights("mnist_mlp")
    for name, old in before.items():
        update = np.float32(0.5) * np.divide(sums[name], np.float32(4), dtype=np.float32)
        np.testing.assert_array_equal(after[name], old - update, err_msg=name)


def test_one_message_over_the_fixed_bound_is_refused_whatever_the_models(
    running: RunningServer, channel: grpc.Channel
) -> None:
    request = _norms_request(1400)  # 4.4 MB: within --max-request-bytes, not one message
    assert request.ByteSize() > MESSAGE_BYTES
    assert running.limits.count("request_bytes") > request.ByteSize()
    refused = _refusal(channel, iter([request]))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first, *_ = _call(channel, "ComputePerExampleGradients", iter(in_chunks(request)))
    assert pb.GradientsResponse.FromString(first).header.batch_size == 1400


def _declaring(shape: list[int]) -> pb.GradientsRequest:
    """A header whose inputs, float32 of this shape, are to follow in chunks."""
    request = _norms_request(2)
    request.inputs.CopyFrom(tensor_pb2.Tensor(dtype=1, shape=shape, chunked=True))
    return request


def test_a_request_declaring_more_than_max_request_bytes_is_refused_before_any_chunk(
    channel: grpc.Channel,
) -> None:
    ended = threading.Event()
    refused = _refusal(channel, _then_silence([_declaring([1 << 20, 784])], ended))
    ended.set()
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-request-bytes" in refused.details()


def _first_message_refused(shape: list[int], **settings: object) -> grpc.RpcError:
    """The refusal of a first message declaring float32 inputs of `shape`, its stream
    left open, by a server of its own with these settings."""
    server = start(loopback_config("mnist_mlp", **settings))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
            ended = threading.Event()
            refused = _refusal(opened, _then_silence([_declaring(shape)], ended))
            ended.set()
    finally:
        server.stop(0)
    return refused


def test_a_request_is_held_from_its_first_message() -> None:
    """Declared bytes past what calls may hold at once are refused before any chunk."""
    settings = {"max_request_bytes": 1 << 30, "max_inflight_bytes": 1 << 24}
    refused = _first_message_refused([4096, 4096], **settings)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-bytes" in refused.details()


def test_a_request_declaring_a_batch_over_max_batch_is_refused_before_any_chunk() -> None:
    refused = _first_message_refused([5000, 784], max_request_bytes=1 << 25, max_batch=4096)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "inputs: batch of 5000 exceeds --max-batch 4096" in refused.details()


def _chunk(tensor: int, offset: int, data: bytes) -> pb.GradientsRequest:
    return pb.GradientsRequest(
        chunk=tensor_pb2.TensorChunk(tensor=tensor, offset=offset, data=data)
    )


@pytest.mark.parametrize(
    ("rows", "chunks", "named"),
    [
        (2, [_chunk(0, 4, bytes(8))], "out of order"),
        (2, [_chunk(0, 0, bytes(4 * 784 * 2 + 4))], "past"),
        (2, [_chunk(3, 0, bytes(8))], "declared"),
        (2, [_chunk(0, 0, bytes(8))], "each chunk but a tensor's last holds"),
        (100, [_chunk(0, 0, bytes(MIN_CHUNK_BYTES))], "truncated"),
        (100, [_chunk(0, 0, bytes(MIN_CHUNK_BYTES)), pb.GradientsRequest()], "only `chunk`"),
    ],
)
def test_a_chunk_out_of_place_or_missing_is_invalid_argument(
    channel: grpc.Channel, rows: int, chunks: list, named: str
) -> None:
    refused = _refusal(channel, iter([_declaring([rows, 784]), *chunks]))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.details()


def test_a_chunk_message_holding_fields_besides_its_chunk_is_invalid_argument(
    channel: grpc.Channel,
) -> None:
    """1 KiB of a field this server does not know beside a chunk: refused, not passed
    through uncharged."""
    chunk = _chunk(0, 0, bytes(4 * 784 * 2)).SerializeToString()
    unknown = b"\x9a\x06" + bytes([0x80, 0x08]) + bytes(1024)  # field 99, 1 KiB
    refused = _refusal(channel, iter([_declaring([2, 784]), chunk + unknown]))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields this server does not know" in refused.details()
    (reply,) = _call(channel, "ComputePerExampleGradients", iter([_declaring([2, 784]), chunk]))
    assert pb.GradientsResponse.FromString(reply).header.batch_size == 2


def test_a_second_request_on_a_call_taking_one_is_invalid_argument(
    channel: grpc.Channel,
) -> None:
    request = _norms_request(4)
    refused = _refusal(channel, iter([*in_chunks(request, inline_bytes=KIB), request]))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than one" in refused.details()


def test_a_request_whose_chunks_stop_coming_is_cancelled_as_stalled(
    channel: grpc.Channel,
) -> None:
    ended = threading.Event()
    first = _chunk(0, 0, bytes(MIN_CHUNK_BYTES))
    refused = _refusal(channel, _then_silence([_declaring([100, 784]), first], ended))
    ended.set()
    assert refused.code() == grpc.StatusCode.CANCELLED


def test_a_request_whose_chunks_trickle_past_the_stall_timeout_is_cancelled(
    channel: grpc.Channel,
) -> None:
    """Each chunk in time, but the whole request not: its held bytes are let go."""

    def trickled() -> Iterator:
        yield _declaring([100, 784])
        for index in range(4):
            time.sleep(0.9)
            yield _chunk(0, index * MIN_CHUNK_BYTES, bytes(MIN_CHUNK_BYTES))

    refused = _refusal(channel, trickled())
    assert refused.code() == grpc.StatusCode.CANCELLED
    assert "--stall-timeout" in refused.details()
