"""The service's methods on one channel, as the client calls them: responses that carry
tensors arrive as bytes, decoded by pergrad's own reader (`wire.chunks`), not protobuf's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.wire.chunks import identity
from pergrad.wire.request_parts import in_parts
from pergrad.wire.rpc import method_path


class Methods:
    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = pb_grpc.GradientServiceStub(channel)
        gradients = pb.GradientsRequest.SerializeToString

        def method(kind: Callable[..., Any], name: str, request: Any, response: Any) -> Any:
            path = method_path(name)
            return kind(path, request_serializer=request, response_deserializer=response)

        compute, stream = "ComputePerExampleGradients", "StreamPerExampleGradients"
        self.compute = one_in_parts(method(channel.stream_stream, compute, gradients, identity))
        self.stream = each_in_parts(method(channel.stream_stream, stream, gradients, identity))
        self.info = method(
            channel.unary_unary, "GetModelInfo", pb.GetModelInfoRequest.SerializeToString, identity
        )
        self.weights = method(
            channel.unary_stream, "GetWeights", pb.GetWeightsRequest.SerializeToString, identity
        )
        self.step = one_in_parts(
            method(
                channel.stream_unary,
                "ApplyStep",
                pb.StepRequest.SerializeToString,
                pb.StepResponse.FromString,
            )
        )


def one_in_parts(call: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking one request, called with the request: sent in parts where its
    tensors are large (`wire.request_parts`)."""
    return lambda request, **kwargs: call(iter(in_parts(request)), **kwargs)


def each_in_parts(call: Callable[..., Any]) -> Callable[..., Any]:
    """A method taking a stream of requests, called with them: each sent in parts where
    its tensors are large, made as the stream asks for the next."""
    return lambda requests, **kwargs: call(
        (part for request in requests for part in in_parts(request)), **kwargs
    )
