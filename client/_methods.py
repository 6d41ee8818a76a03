"""The service's methods on one channel, as the client calls them: responses that carry
tensors arrive as bytes, decoded by pergrad's own reader (`wire.chunks`), not protobuf's."""

from __future__ import annotations

import grpc

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.wire.chunks import identity
from pergrad.wire.rpc import method_path


class Methods:
    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = pb_grpc.GradientServiceStub(channel)
        self.compute = channel.unary_stream(
            method_path("ComputePerExampleGradients"),
            request_serializer=pb.GradientsRequest.SerializeToString,
            response_deserializer=identity,
        )
        self.info = channel.unary_unary(
            method_path("GetModelInfo"),
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=identity,
        )
        self.weights = channel.unary_stream(
            method_path("GetWeights"),
            request_serializer=pb.GetWeightsRequest.SerializeToString,
            response_deserializer=identity,
        )
        self.stream = channel.stream_stream(
            method_path("StreamPerExampleGradients"),
            request_serializer=pb.GradientsRequest.SerializeToString,
            response_deserializer=identity,
        )
        self.step = channel.unary_unary(
            method_path("ApplyStep"),
            request_serializer=pb.StepRequest.SerializeToString,
            response_deserializer=pb.StepResponse.FromString,
        )
