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
        self.compute = chunked_one(method(channel.stream_stream, compute, serialize, identity))
        self.stream = chunked_each(method(channel.stream_stream, stream, serialize, identity))
        self.info = method(
            channel.unary_unary, "GetModelInfo", pb.GetModelInfoRequest.SerializeToString, identity
        )
        self.weights = method(
            channel.unary_stream, "GetWeights", pb.GetWeightsRequest.SerializeToString, identity
        )
        self.step = chunked_one(
            method(
                channel.stream_unary,
                "ApplyStep",
                serialize,
                pb.StepResponse.FromString,
            )
        )


def chunked_one(call: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking one request, called with the request: sent in chunks where its
    tensors are large (`wire.chunked_requests`)."""
    return lambda request, **kwargs: call(iter(in_chunks(request)), **kwargs)


def chunked_each(call: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking a stream of requests, called with them: each sent in chunks where
    its tensors are large, made as the stream asks for the next."""
    return lambda requests, **kwargs: call(
        (part for request in requests for part in in_chunks(request)), **kwargs
    )
