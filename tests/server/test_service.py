"""The service end to end: a real gRPC server on 127.0.0.1 and the real client."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pergrad.client import GradientClient, ModelInfo, PergradError, ServerLimits
from pergrad.server.config import AUTO_COALESCED_BATCH, AUTO_REQUEST_BYTES, Config
from pergrad.server.main import SERVICE_NAME, RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunks import Part, decode_response
from pergrad.wire.codec import TensorAssembler
from pergrad.wire.messages import gradients_request
from tests import oracle
from tests.helpers import KERAS_MODEL_NAME, assert_close, batch_for, loopback_config


def _served_model(name: str, model_dir: Path | None) -> tuple[keras.Model, Any]:
    """A model as the server starts it, and its Keras loss: a built-in from its fixed
    seeds, the .keras file as Keras loads it (its variable paths are the loaded model's)."""
    if name == KERAS_MODEL_NAME:
        model = keras.saving.load_model(model_dir / f"{name}.keras")
        return model, model.loss
    return BUILTIN_MODELS[name](), LOSS


def _oracle(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    *,
    model_dir: Path | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    model, loss = _served_model(name, model_dir)
    return oracle.per_example(model, loss, x, y, weights=weights)


def _batch(client: GradientClient, name: str, size: int, seed: int = 0):
    info = client.model_info(name)
    return batch_for(info.input.shape[1:], info.num_classes, size, seed)


def test_list_models_names_every_served_model(client: GradientClient) -> None:
    assert client.list_models() == sorted(["mnist_cnn", "mnist_mlp", KERAS_MODEL_NAME])


def test_model_info_describes_variables_input_labels_and_loss(client: GradientClient) -> None:
    info = client.model_info("mnist_cnn")
    assert info.model_version == 1
    assert [v.name for v in info.variables][:2] == ["conv1/kernel", "conv1/bias"]
    assert info.variables[0].shape == (8, 8, 1, 16)
    assert info.input.shape == (-1, 28, 28, 1) and info.input.dtype == np.float32
    assert info.labels.shape == (-1,) and info.labels.dtype == np.int32
    assert info.num_classes == 10 and "from_logits=True" in info.loss


def test_model_info_reports_the_servers_limits_and_plan(client: GradientClient) -> None:
    """What a client needs to size batches and to know replicas agree; the conftest
    server runs with --max-batch 512, --jit-compile off, passes shared (`loopback_config`)
    and the other defaults: its message limit is gRPC's default plus the most a served
    model's request holds that no client can split (a `dot` reference row or a step's
    gradient sum in float32, and one example)."""
    info = client.model_info("mnist_mlp")
    defaults = Config()
    assert info.limits == ServerLimits(
        max_batch=512,
        max_request_bytes=AUTO_REQUEST_BYTES + max(map(_unsplittable, _infos(client))),
        max_inflight_examples=defaults.max_inflight_examples,
        max_inflight_bytes=defaults.max_inflight_bytes,
        max_coalesced_batch=AUTO_COALESCED_BATCH,
    )
    assert info.plan.startswith("XLA off; slices of ") and "closed-form rules: " in info.plan
    assert len(info.plan_id) == 12 and info.loss_dtype == np.float32
    x, y = batch_for((784,), 10, 3)
    assert client.per_example_gradients("mnist_mlp", x, y, reduction="norms").plan_id == (
        info.plan_id
    )


def _infos(client: GradientClient) -> list[ModelInfo]:
    return [client.model_info(name) for name in client.list_models()]


def _unsplittable(info: ModelInfo) -> int:
    """A variable's row in float32, and one example (sizes of free size taken as 1)."""
    variables = sum(4 * int(np.prod(v.shape)) for v in info.variables)
    tensors = [*info.inputs, info.labels]
    example = sum(
        t.dtype.itemsize * int(np.prod([max(d, 1) for d in t.shape[1:]])) for t in tensors
    )
    return variables + example


def test_replicas_that_share_passes_and_one_that_does_not_report_different_plans() -> None:
    """A small request's bits depend on whether it shares passes (a shared pass's rows
    are reduced outside it): replicas differing there must not report one plan_id."""
    infos, results = [], []
    x, y = batch_for((784,), 10, 4)
    for bound in (AUTO_COALESCED_BATCH, 0):
        running = start(loopback_config("mnist_mlp", max_coalesced_batch=bound))
        try:
            with GradientClient(f"127.0.0.1:{running.port}") as client:
                infos.append(client.model_info("mnist_mlp"))
                results.append(client.per_example_gradients("mnist_mlp", x, y, reduction="norms"))
        finally:
            running.stop(0)
    shared, alone = infos
    assert shared.plan_id != alone.plan_id
    assert shared.plan.endswith(f"fewer than {AUTO_COALESCED_BATCH} examples share passes")
    assert alone.plan.endswith("no shared passes")
    assert [r.plan_id for r in results] == [shared.plan_id, alone.plan_id]


@pytest.mark.parametrize("name", ["mnist_mlp", "mnist_cnn", KERAS_MODEL_NAME])
def test_remote_gradients_match_keras_oracle(
    client: GradientClient, model_dir: Path, name: str
) -> None:
    x, y = _batch(client, name, 7)
    result = client.per_example_gradients(name, x, y)
    losses, grads = _oracle(name, x, y, model_dir=model_dir)
    assert result.model_version == 1 and result.model == name
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


def test_result_larger_than_4_mib_arrives_intact(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 64)
    result = client.per_example_gradients("mnist_mlp", x, y)
    assert sum(g.nbytes for g in result.gradients.values()) > 4 << 20
    assert_close(result.gradients, _oracle("mnist_mlp", x, y)[1])


def test_numpy_defaults_are_cast_to_model_dtypes(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 5)
    wide = client.per_example_gradients(
        "mnist_mlp", np.asfortranarray(x, np.float64), y.astype(np.int64)
    )
    exact = client.per_example_gradients("mnist_mlp", x, y)
    np.testing.assert_array_equal(wide.losses, exact.losses)


def test_float_labels_for_class_indices_are_refused_by_the_client(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 2)
    with pytest.raises(PergradError, match="labels: model expects int32, got float64") as err:
        client.per_example_gradients("mnist_mlp", x, y.astype(np.float64) + 0.5)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_stream_returns_every_batch_in_order(client: GradientClient) -> None:
    batches = [_batch(client, "mnist_cnn", size, seed=size) for size in (3, 1, 5, 2)]
    results = list(client.stream("mnist_cnn", iter(batches)))
    assert [r.batch_size for r in results] == [3, 1, 5, 2]
    for (x, y), result in zip(batches, results, strict=True):
        single = client.per_example_gradients("mnist_cnn", x, y)
        assert_close(result.gradients, single.gradients)


def test_streamed_results_match_keras_oracle(client: GradientClient) -> None:
    batches = [_batch(client, "mnist_cnn", size, seed=size) for size in (3, 2)]
    for (x, y), result in zip(batches, client.stream("mnist_cnn", iter(batches)), strict=True):
        losses, grads = _oracle("mnist_cnn", x, y)
        assert_close({"losses": result.losses}, {"losses": losses})
        assert_close(result.gradients, grads)


def test_stream_reports_the_failing_batch(client: GradientClient) -> None:
    good = _batch(client, "mnist_mlp", 2)
    bad = (good[0], np.array([0, 99], np.int32))
    with pytest.raises(PergradError, match="request 2: labels: class index 99") as err:
        list(client.stream("mnist_mlp", [good, bad, good]))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_set_weights_changes_gradients_and_version(fresh_client: GradientClient) -> None:
    version, weights = fresh_client.get_weights("mnist_mlp")
    scaled = {name: w * 1.5 for name, w in weights.items()}
    assert fresh_client.set_weights("mnist_mlp", scaled) == version + 1
    x, y = _batch(fresh_client, "mnist_mlp", 3)
    result = fresh_client.per_example_gradients("mnist_mlp", x, y)
    assert result.model_version == version + 1
    assert_close(result.gradients, _oracle("mnist_mlp", x, y, weights=scaled)[1])
    assert fresh_client.get_weights("mnist_mlp")[0] == version + 1


def test_set_weights_with_a_wrong_shape_changes_nothing(fresh_client: GradientClient) -> None:
    version, weights = fresh_client.get_weights("mnist_mlp")
    broken = {**{n: w + 1 for n, w in weights.items()}, "logits/bias": np.zeros(11, np.float32)}
    with pytest.raises(PergradError, match=r"weights\['logits/bias'\]: float32 \[11\]") as err:
        fresh_client.set_weights("mnist_mlp", broken)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    after_version, after = fresh_client.get_weights("mnist_mlp")
    assert after_version == version
    for name in weights:
        np.testing.assert_array_equal(after[name], weights[name])


def test_set_weights_missing_a_variable_is_refused(fresh_client: GradientClient) -> None:
    _, weights = fresh_client.get_weights("mnist_mlp")
    del weights["hidden/bias"]
    with pytest.raises(PergradError, match=r"missing \['hidden/bias'\]"):
        fresh_client.set_weights("mnist_mlp", weights)


def test_set_weights_with_a_stale_expected_version_is_refused(fresh_client: GradientClient) -> None:
    version, weights = fresh_client.get_weights("mnist_mlp")
    fresh_client.set_weights("mnist_mlp", weights, expected_version=version)
    with pytest.raises(PergradError, match="another update came first") as err:
        fresh_client.set_weights("mnist_mlp", weights, expected_version=version)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_pinned_version_that_is_not_current_fails_precondition(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 2)
    assert client.per_example_gradients("mnist_mlp", x, y, model_version=1).model_version == 1
    with pytest.raises(PergradError, match="model_version 7 is not current") as err:
        client.per_example_gradients("mnist_mlp", x, y, model_version=7)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("model", "x", "y", "code", "message"),
    [
        (
            "nope",
            np.zeros((2, 784), np.float32),
            np.zeros(2, np.int32),
            grpc.StatusCode.NOT_FOUND,
            "model 'nope' not found",
        ),
        (
            "mnist_mlp",
            np.zeros((2, 780), np.float32),
            np.zeros(2, np.int32),
            grpc.StatusCode.INVALID_ARGUMENT,
            "inputs: shape [2, 780]",
        ),
        (
            "mnist_mlp",
            np.zeros((2, 784), np.float32),
            np.array([3, 10], np.int32),
            grpc.StatusCode.INVALID_ARGUMENT,
            "labels: class index 10 out of range [0, 10)",
        ),
        (
            "mnist_mlp",
            np.zeros((0, 784), np.float32),
            np.zeros(0, np.int32),
            grpc.StatusCode.INVALID_ARGUMENT,
            "inputs: empty batch",
        ),
    ],
)
def test_bad_requests_get_a_precise_status_and_server_keeps_serving(
    client: GradientClient, model, x, y, code, message
) -> None:
    with pytest.raises(PergradError) as err:
        client.per_example_gradients(model, x, y)
    assert err.value.code == code
    assert message in err.value.message
    ok = client.per_example_gradients("mnist_mlp", *_batch(client, "mnist_mlp", 1))
    assert ok.batch_size == 1


def test_wrong_input_dtype_on_the_wire_is_refused(server: RunningServer) -> None:
    from pergrad.v1 import gradient_service_pb2 as pb
    from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
    from pergrad.wire.codec import encode_tensor

    request = pb.GradientsRequest(
        model="mnist_mlp",
        inputs=encode_tensor(np.zeros((2, 784), np.float64)),
        labels=encode_tensor(np.zeros(2, np.int32)),
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ComputePerExampleGradients(iter([request]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs: dtype float64, model expects float32" in err.value.details()


def test_tensor_bytes_that_do_not_match_the_shape_are_refused(server: RunningServer) -> None:
    from pergrad.v1 import gradient_service_pb2 as pb
    from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
    from pergrad.v1 import tensor_pb2

    request = pb.GradientsRequest(
        model="mnist_mlp",
        inputs=tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[2, 784], content=b"\0" * 100
        ),
        labels=tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_INT32, shape=[2], content=b"\0" * 8),
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ComputePerExampleGradients(iter([request]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs: float32 [2, 784] needs 6272 bytes, got 100" in err.value.details()


def test_health_reports_serving(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_gradient_service(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    names = [s.name for s in reply.list_services_response.service]
    assert SERVICE_NAME in names


# Rounding to nearest moves a value by at most half an ulp: 2**-11 of it in float16 (11
# significant bits), 2**-8 in bfloat16 (8). Below float16's smallest normal, 2**-14, its
# ulp is fixed at 2**-24, so a value there moves by at most 2**-25 (bfloat16 keeps
# float32's exponent range: no float32 gradient here lies below its normals).
HALF_PRECISION = {"float16": (2**-11, 2**-25), "bfloat16": (2**-8, 0.0)}


@pytest.mark.parametrize("wire_dtype", sorted(HALF_PRECISION))
def test_half_precision_on_the_wire_keeps_the_values(client: GradientClient, wire_dtype) -> None:
    x, y = _batch(client, "mnist_mlp", 4)
    exact = client.per_example_gradients("mnist_mlp", x, y)
    half = client.per_example_gradients("mnist_mlp", x, y, wire_dtype=wire_dtype)
    upcast = client.per_example_gradients("mnist_mlp", x, y, wire_dtype=wire_dtype, upcast=True)
    assert half.gradients["hidden/kernel"].dtype.name == wire_dtype
    assert upcast.gradients["hidden/kernel"].dtype == np.float32
    assert half.losses.dtype == np.float32
    rtol, atol = HALF_PRECISION[wire_dtype]
    for name, value in exact.gradients.items():
        np.testing.assert_allclose(upcast.gradients[name], value, rtol=rtol, atol=atol)


def test_wire_dtype_with_a_reduction_is_refused(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 2)
    with pytest.raises(PergradError, match="wire_dtype applies to none") as err:
        client.per_example_gradients("mnist_mlp", x, y, reduction="norms", wire_dtype="float16")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_out_refills_the_arrays_of_a_previous_result(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 4)
    first = client.per_example_gradients("mnist_mlp", x, y)
    kernel = first.gradients["hidden/kernel"]
    x2, y2 = _batch(client, "mnist_mlp", 4, seed=9)
    again = client.per_example_gradients("mnist_mlp", x2, y2, out=first)
    assert again.gradients["hidden/kernel"] is kernel
    fresh = client.per_example_gradients("mnist_mlp", x2, y2)
    np.testing.assert_array_equal(kernel, fresh.gradients["hidden/kernel"])


def test_out_of_another_shape_is_refused(client: GradientClient) -> None:
    x, y = _batch(client, "mnist_mlp", 4)
    small = client.per_example_gradients("mnist_mlp", x[:2], y[:2])
    with pytest.raises(PergradError, match="does not fit"):
        client.per_example_gradients("mnist_mlp", x, y, out=small)


def _replies(server: RunningServer, request: pb.GradientsRequest) -> list[Part]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream(f"/{SERVICE_NAME}/ComputePerExampleGradients")
        return [decode_response(r) for r in call(request.SerializeToString(), timeout=60)]


def _norms_request(size: int, *, inline: bool) -> pb.GradientsRequest:
    x, y = batch_for((784,), 10, size)
    norms = CATALOGUE.get("norms")
    request = gradients_request("mnist_mlp", x, y, reduction=norms, options={}).inline()
    request.inline_result = inline
    return request


def _result(replies: list[Part]) -> list[np.ndarray]:
    header = replies[0].header
    assembler = TensorAssembler([o.tensor for o in header.outputs])
    if header.data:
        assembler.add_inline(header.data)
    for part in replies[1:]:
        assembler.add_raw(*part.chunk)
    return assembler.arrays()


def test_a_small_result_asked_inline_is_one_message_with_the_chunked_bytes(server) -> None:
    inline = _replies(server, _norms_request(6, inline=True))
    chunked = _replies(server, _norms_request(6, inline=False))
    assert len(inline) == 1 and len(chunked) == 1 + len(chunked[0].header.outputs)
    assert not chunked[0].header.data
    for got, want in zip(_result(inline), _result(chunked), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_result_over_one_chunk_comes_in_chunks_even_asked_inline(server) -> None:
    request = _norms_request(6, inline=True)
    request.reduction = CATALOGUE.get("none").number  # 6 x 101,770 floats: 2.4 MB
    replies = _replies(server, request)
    assert not replies[0].header.data and len(replies) > 1 + len(replies[0].header.outputs)
