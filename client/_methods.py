"""The service's methods on one channel, as the client calls them: responses that carry
tensors arrive as bytes, decoded by pergrad's own reader (`wire.chunks`), not protobuf's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.wire.chunked_requests import in_chunks
from pergrad.wire.chunks import identity, serialize
from pergrad.wire.rpc import method_path


class Methods:
    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = pb_grpc.GradientServiceStub(channel)

        def method(kind: Callable[..., Any], name: str, request: Any, response: Any) -> Any:
            path = method_path(name)
            return kind(path, request_serializer=request, response_deserializer=response)

        compute, stream = "ComputePerExampleGradients", "StreamPerExampleGradients"
        self.compute = chunked_one(
            method(channel.unary_stream, compute, serialize, identity),
            method(channel.stream_stream, compute, serialize, identity),
        )
        self.stream = chunked_each(method(channel.stream_stream, stream, serialize, identity))
        self.info = method(
            channel.unary_unary, "GetModelInfo", pb.GetModelInfoRequest.SerializeToString, identity
        )
        self.weights = method(
            channel.unary_stream, "GetWeights", pb.GetWeightsRequest.SerializeToString, identity
        )
        step, reply = "ApplyStep", pb.StepResponse.FromString
        self.step = chunked_one(
            method(channel.unary_unary, step, serialize, reply),
            method(channel.stream_unary, step, serialize, reply),
        )


def chunked_one(whole: Callable[..., Any], chunked: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking one request, called with the request: one message on the
    one-request form of the call (the same on the wire; grpcio reads a unary-stream
    call's responses on the calling thread, a streaming call costs it a thread more:
    about 0.6 ms of a small call here), or in chunks where its tensors are large
    (`wire.chunked_requests`)."""

    def call(request: Any, **kwargs: Any) -> Any:
        messages = in_chunks(request)
        if len(messages) == 1:
            return whole(messages[0], **kwargs)
        return chunked(iter(messages), **kwargs)

    return call


def chunked_each(call: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking a stream of requests, called with them: each sent in chunks where
    its tensors are large, made as the stream asks for the next."""
    return lambda requests, **kwargs: call(
        (part for request in requests for part in in_chunks(request)), **kwargs
    )
