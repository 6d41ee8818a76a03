"""Bearer tokens on a real server: missing, wrong, right and read-only; open probes.

One plaintext server for the module reads a token file with a read-write and a
read-only token; the refused calls are also checked in its /metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import SERVICE_NAME, RunningServer, start
from pergrad.server.transport.auth import TokenFileError, load_tokens, parse_tokens
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from tests.helpers import batch_for, loopback_config
from tests.prometheus import sample_value, scrape

WRITER, READER = "writer-4f6c2a", "reader-9b1d7e"
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# pergrad tokens\n{WRITER}\n\n{READER}:ro\n")
    return path


@pytest.fixture(scope="module")
def server(token_file: Path) -> Iterator[RunningServer]:
    running = start(loopback_config("mnist_mlp", auth_token_file=token_file))
    yield running
    running.stop(0)


@pytest.fixture(scope="module")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    """A bare channel, for calls with metadata of the test's own making."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as bare:
        yield bare


def connect(server: RunningServer, token: str | None) -> GradientClient:
    return GradientClient(f"127.0.0.1:{server.port}", timeout=TIMEOUT_S, token=token)


def list_models_code(server: RunningServer, token: str | None) -> grpc.StatusCode:
    with connect(server, token) as client:
        try:
            client.list_models()
        except PergradError as err:
            return err.code
    return grpc.StatusCode.OK


def raw_list_models_code(channel: grpc.Channel, authorization: str) -> grpc.StatusCode:
    stub = pb_grpc.GradientServiceStub(channel)
    try:
        stub.ListModels(
            pb.ListModelsRequest(), metadata=[("authorization", authorization)], timeout=TIMEOUT_S
        )
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_call_without_token_is_unauthenticated(server: RunningServer) -> None:
    assert list_models_code(server, None) == grpc.StatusCode.UNAUTHENTICATED


def test_call_with_wrong_token_is_unauthenticated(server: RunningServer) -> None:
    assert list_models_code(server, WRITER + "x") == grpc.StatusCode.UNAUTHENTICATED


def test_call_with_right_token_succeeds(server: RunningServer) -> None:
    assert list_models_code(server, WRITER) == grpc.StatusCode.OK


def test_bearer_scheme_is_case_insensitive(channel: grpc.Channel) -> None:
    assert raw_list_models_code(channel, f"bearer {WRITER}") == grpc.StatusCode.OK


def test_other_authorization_schemes_are_unauthenticated(channel: grpc.Channel) -> None:
    assert raw_list_models_code(channel, f"Basic {WRITER}") == grpc.StatusCode.UNAUTHENTICATED


def test_stream_without_token_is_unauthenticated(channel: grpc.Channel) -> None:
    stub = pb_grpc.GradientServiceStub(channel)
    responses = stub.StreamPerExampleGradients(
        iter([pb.GradientsRequest(model="mnist_mlp")]), timeout=TIMEOUT_S
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(responses)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_stream_with_token_returns_every_result(server: RunningServer) -> None:
    batches = [batch_for((784,), 10, 2, seed=seed) for seed in range(3)]
    with connect(server, READER) as client:
        results = list(client.stream("mnist_mlp", batches))
    assert [r.batch_size for r in results] == [2, 2, 2]


def test_read_only_token_computes_gradients(server: RunningServer) -> None:
    x, y = batch_for((784,), 10, 4)
    with connect(server, READER) as client:
        result = client.per_example_gradients("mnist_mlp", x, y)
    assert result.gradients["hidden/kernel"].shape == (4, 784, 128)


def test_read_only_token_cannot_set_weights(server: RunningServer) -> None:
    with connect(server, READER) as client:
        version, weights = client.get_weights("mnist_mlp")
        with pytest.raises(PergradError) as refused:
            client.set_weights("mnist_mlp", weights)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "read-only" in refused.value.message
        assert client.model_info("mnist_mlp").model_version == version


def test_read_only_token_cannot_step(server: RunningServer) -> None:
    x, y = batch_for((784,), 10, 4)
    with connect(server, READER) as client:
        before = client.model_info("mnist_mlp")
        with pytest.raises(PergradError) as refused:
            client.step("mnist_mlp", x, y, learning_rate=0.1, max_norm=1.0)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "ApplyStep" in refused.value.message
        assert client.model_info("mnist_mlp").weights_id == before.weights_id


def test_read_write_token_steps(server: RunningServer) -> None:
    x, y = batch_for((784,), 10, 4)
    with connect(server, WRITER) as client:
        version = client.model_info("mnist_mlp").model_version
        step = client.step("mnist_mlp", x, y, learning_rate=0.1, max_norm=1.0)
    assert step.model_version == version + 1


def test_read_write_token_sets_weights(server: RunningServer) -> None:
    with connect(server, WRITER) as client:
        version, weights = client.get_weights("mnist_mlp")
        new_version = client.set_weights("mnist_mlp", weights, expected_version=version)
        _, after = client.get_weights("mnist_mlp")
    assert new_version == version + 1
    np.testing.assert_array_equal(after["hidden/kernel"], weights["hidden/kernel"])


def test_health_answers_without_token(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_answers_without_token(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S)
    names = {s.name for s in reply.list_services_response.service}
    assert SERVICE_NAME in names


def test_refused_calls_are_counted_by_their_status_code(server: RunningServer) -> None:
    def refused() -> float:
        exposition = scrape(server.metrics_port)
        labels = {"grpc_method": "ListModels", "grpc_code": "UNAUTHENTICATED"}
        return sample_value(exposition, "grpc_server_handled_total", **labels) or 0.0

    before = refused()
    list_models_code(server, None)
    assert refused() == before + 1


def test_token_file_marks_read_only_tokens() -> None:
    tokens = parse_tokens("a\nb:ro\n")
    assert tokens.lookup("a") is False
    assert tokens.lookup("b") is True
    assert tokens.lookup("b:ro") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# only a comment\n\n", "holds no tokens"),
        ("two words\n", "line 1: a token is one word"),
        ("a\na:ro\n", "line 2: token listed both read-only and read-write"),
        (":ro\n", "line 1: a token is one word"),
    ],
)
def test_unusable_token_file_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(TokenFileError, match=message):
        parse_tokens(text)


def test_a_token_file_saved_with_a_byte_order_mark_keeps_its_first_token(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes("\ufefffirst-token\nsecond:ro\n".encode())
    tokens = load_tokens(path)
    assert tokens.lookup("first-token") is False
    assert tokens.lookup("second") is True
