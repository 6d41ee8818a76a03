"""The metrics a running server exports: real servers on 127.0.0.1, the real client, /metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunked_requests import in_chunks
from pergrad.wire.chunks import serialize
from pergrad.wire.codec import encode_tensor
from tests.helpers import KERAS_MODEL_NAME, batch_for, loopback_config
from tests.prometheus import promtool, sample_names, scrape

COMPUTE = "ComputePerExampleGradients"
STREAM = "StreamPerExampleGradients"
SERVICE = "pergrad.v1.GradientService"
MLP = {"model": "mnist_mlp", "reduction": "none"}


def _value(server: RunningServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


def _handled(server: RunningServer, method: str, grpc_type: str, code: str) -> float:
    return _value(
        server,
        "grpc_server_handled_total",
        grpc_type=grpc_type,
        grpc_service=SERVICE,
        grpc_method=method,
        grpc_code=code,
    )


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _mlp_batch(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return batch_for((784,), 10, size, seed)


def _raw_request(model: str, size: int) -> pb.GradientsRequest:
    x, y = _mlp_batch(size)
    return pb.GradientsRequest(model=model, inputs=encode_tensor(x), labels=encode_tensor(y))


def test_metrics_endpoint_answers_prometheus_text_at_metrics(server: RunningServer) -> None:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    names = sample_names(text)
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    assert "pergrad_weights_version" in names


def test_each_server_has_its_own_registry_and_port(
    server: RunningServer, fresh_server: RunningServer, fresh_client: GradientClient
) -> None:
    assert server.metrics_port != fresh_server.metrics_port
    assert server.metrics.registry is not fresh_server.metrics.registry
    before = _value(server, "pergrad_examples_processed_total", **MLP)
    fresh_client.per_example_gradients("mnist_mlp", *_mlp_batch(3))
    assert _value(fresh_server, "pergrad_examples_processed_total", **MLP) == 3
    assert _value(server, "pergrad_examples_processed_total", **MLP) == before


def test_every_served_model_is_exported_with_its_weights_version(server: RunningServer) -> None:
    for model in ("mnist_mlp", "mnist_cnn", KERAS_MODEL_NAME):
        assert _value(server, "pergrad_weights_version", model=model) == 1
        registry = server.metrics.registry
        assert registry.get_sample_value("pergrad_weights_updates_total", {"model": model}) == 0


def test_gradients_request_counts_its_examples_bytes_and_phases(
    server: RunningServer, client: GradientClient
) -> None:
    names = [
        "pergrad_request_queue_seconds_count",
        "pergrad_request_compute_seconds_count",
        "pergrad_request_serialize_seconds_count",
    ]
    labels = [{}, MLP, MLP]
    counts = [_value(server, n, **lab) for n, lab in zip(names, labels, strict=True)]
    examples = _value(server, "pergrad_examples_processed_total", **MLP)
    sent = _value(server, "pergrad_response_bytes_total", model="mnist_mlp")
    result = client.per_example_gradients("mnist_mlp", *_mlp_batch(5))
    after = [_value(server, n, **lab) for n, lab in zip(names, labels, strict=True)]
    assert [a - b for a, b in zip(after, counts, strict=True)] == [1, 1, 1]
    assert _value(server, "pergrad_examples_processed_total", **MLP) - examples == 5
    payload = sum(g.nbytes for g in result.gradients.values()) + result.losses.nbytes
    grown = _value(server, "pergrad_response_bytes_total", model="mnist_mlp") - sent
    assert payload < grown < payload * 1.01
    assert _value(server, "pergrad_request_compute_seconds_sum", **MLP) > 0
    assert _value(server, "pergrad_requests_in_flight") == 0
    assert _value(server, "pergrad_examples_in_flight") == 0


def test_reduction_request_counts_examples_under_its_reduction(
    server: RunningServer, client: GradientClient
) -> None:
    norms = {"model": "mnist_mlp", "reduction": "norms"}
    before = _value(server, "pergrad_examples_processed_total", **norms)
    client.per_example_gradients("mnist_mlp", *_mlp_batch(6), reduction="norms")
    assert _value(server, "pergrad_examples_processed_total", **norms) == before + 6
    assert _value(server, "pergrad_request_compute_seconds_count", **norms) >= 1


def test_stream_measures_each_batch_as_a_request(
    server: RunningServer, client: GradientClient
) -> None:
    computed = _value(server, "pergrad_request_compute_seconds_count", **MLP)
    examples = _value(server, "pergrad_examples_processed_total", **MLP)
    batches = [_mlp_batch(size, seed=size) for size in (2, 3, 4)]
    assert len(list(client.stream("mnist_mlp", batches))) == 3
    assert _value(server, "pergrad_request_compute_seconds_count", **MLP) - computed == 3
    assert _value(server, "pergrad_examples_processed_total", **MLP) - examples == 9


def test_in_flight_gauges_hold_a_request_until_it_ends(fresh_server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        responses = stub.ComputePerExampleGradients(
            iter([_raw_request("mnist_mlp", 256)]), timeout=60
        )
        assert next(responses).HasField("header")
        # 100 MB of gradients cannot all be buffered: the call stays open until read
        assert _value(fresh_server, "pergrad_requests_in_flight") == 1
        assert _value(fresh_server, "pergrad_examples_in_flight") == 256
        assert sum(1 for _ in responses) > 1
    assert _until(lambda: _value(fresh_server, "pergrad_requests_in_flight") == 0)
    assert _value(fresh_server, "pergrad_examples_in_flight") == 0
    assert _value(fresh_server, "pergrad_examples_processed_total", **MLP) == 256


def test_cancelled_request_counts_no_examples(fresh_server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        responses = stub.ComputePerExampleGradients(
            iter([_raw_request("mnist_mlp", 256)]), timeout=60
        )
        next(responses)
        responses.cancel()
        assert _until(lambda: _handled(fresh_server, COMPUTE, "server_stream", "CANCELLED") == 1)
    assert _until(lambda: _value(fresh_server, "pergrad_examples_in_flight") == 0)
    assert _value(fresh_server, "pergrad_requests_in_flight") == 0
    assert _value(fresh_server, "pergrad_examples_processed_total", **MLP) == 0


def test_refused_request_is_counted_by_its_status_code(server: RunningServer) -> None:
    rejected = _value(server, "pergrad_requests_rejected_total", reason="NOT_FOUND")
    handled = _handled(server, COMPUTE, "server_stream", "NOT_FOUND")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ComputePerExampleGradients(iter([_raw_request("nope", 1)]), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _value(server, "pergrad_requests_rejected_total", reason="NOT_FOUND") == rejected + 1
    assert _handled(server, COMPUTE, "server_stream", "NOT_FOUND") == handled + 1


def test_stream_failing_after_results_ends_with_its_status_code(
    server: RunningServer, client: GradientClient
) -> None:
    handled = _handled(server, STREAM, "bidi_stream", "INVALID_ARGUMENT")
    examples = _value(server, "pergrad_examples_processed_total", **MLP)
    good = _mlp_batch(2)
    bad = (good[0], np.array([0, 99], np.int32))
    with pytest.raises(PergradError):
        list(client.stream("mnist_mlp", [good, bad, good]))
    assert _until(lambda: _handled(server, STREAM, "bidi_stream", "INVALID_ARGUMENT") > handled)
    assert _handled(server, STREAM, "bidi_stream", "INVALID_ARGUMENT") == handled + 1
    assert _value(server, "pergrad_examples_processed_total", **MLP) == examples + 2


def test_set_weights_exports_the_new_version(
    fresh_server: RunningServer, fresh_client: GradientClient
) -> None:
    _, weights = fresh_client.get_weights("mnist_mlp")
    fresh_client.set_weights("mnist_mlp", weights)
    assert _value(fresh_server, "pergrad_weights_version", model="mnist_mlp") == 2
    assert _value(fresh_server, "pergrad_weights_updates_total", model="mnist_mlp") == 1


def test_failed_set_weights_is_counted_and_keeps_the_version(
    fresh_server: RunningServer, fresh_client: GradientClient
) -> None:
    _, weights = fresh_client.get_weights("mnist_mlp")
    weights["logits/bias"] = np.zeros(11, np.float32)
    with pytest.raises(PergradError):
        fresh_client.set_weights("mnist_mlp", weights)
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1
    assert _value(fresh_server, "pergrad_weights_version", model="mnist_mlp") == 1


def test_a_step_over_max_batch_is_counted_as_a_failed_update(
    fresh_server: RunningServer,
) -> None:
    """A step whose batch is over --max-batch is refused before its tensors are decoded,
    and counts for the model it names (a step naming no served model counts for none)."""
    batch = pb.GradientsRequest(
        inputs=tensor_pb2.Tensor(dtype=1, shape=[5000, 784], content=bytes(1 << 20)),
        labels=tensor_pb2.Tensor(dtype=5, shape=[5000], content=bytes(20000)),
    )
    refused = [
        ("mnist_mlp", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("no_such_model", grpc.StatusCode.NOT_FOUND),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        step = channel.unary_unary(f"/{SERVICE}/ApplyStep")
        for model, code in refused:
            request = pb.StepRequest(model=model, batch=batch, learning_rate=0.1)
            with pytest.raises(grpc.RpcError) as err:
                step(request.SerializeToString(), timeout=30)
            assert err.value.code() == code
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="no_such_model") == 0
    assert _value(fresh_server, "pergrad_weights_version", model="mnist_mlp") == 1


def test_a_step_refused_while_its_chunks_are_read_is_counted_as_a_failed_update(
    fresh_server: RunningServer,
) -> None:
    """A step whose batch comes in chunks, its last chunk never sent: refused once its
    stream ends, before the servicer's method runs, and counted for the model it names."""
    x, y = batch_for((784,), 10, 512)
    batch = pb.GradientsRequest(
        inputs=encode_tensor(x), labels=encode_tensor(y), reduction=pb.REDUCTION_MOMENTS
    )
    step = pb.StepRequest(model="mnist_mlp", learning_rate=0.1, batch=batch)
    *sent, _ = in_chunks(step, inline_bytes=1024)
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        apply_step = channel.stream_unary(f"/{SERVICE}/ApplyStep")
        with pytest.raises(grpc.RpcError) as err:
            apply_step(
                iter([m if isinstance(m, bytes) else m.SerializeToString() for m in sent]),
                timeout=30,
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1
    assert _value(fresh_server, "pergrad_weights_version", model="mnist_mlp") == 1


def test_a_step_refused_for_the_bytes_it_would_hold_is_counted_as_a_failed_update() -> None:
    """A step in chunks declaring more bytes than calls may hold at once is refused by the
    guard from its first message (--max-inflight-bytes), and counts for its model."""
    running = start(loopback_config("mnist_mlp", max_inflight_bytes=1 << 20))
    x, y = batch_for((784,), 10, 512)  # 1.6 MB
    batch = pb.GradientsRequest(
        inputs=encode_tensor(x), labels=encode_tensor(y), reduction=pb.REDUCTION_MOMENTS
    )
    messages = in_chunks(pb.StepRequest(model="mnist_mlp", learning_rate=0.1, batch=batch))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            apply_step = channel.stream_unary(f"/{SERVICE}/ApplyStep")
            with pytest.raises(grpc.RpcError) as err:
                apply_step(iter([serialize(m) for m in messages]), timeout=30)
        failures = _value(running, "pergrad_weights_update_failures_total", model="mnist_mlp")
    finally:
        running.stop(0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-bytes" in err.value.details()
    assert failures == 1


def test_a_step_refused_before_parsing_is_counted_as_a_failed_update(
    fresh_server: RunningServer,
) -> None:
    """A step whose batch holds 80,000 small fields is refused from its bytes, before any
    handler runs, and still counts for the model it names (not for one it does not)."""
    batch = pb.GradientsRequest(reduction=pb.REDUCTION_DOT)
    for i in range(80_000):
        batch.reference[f"v{i}"].CopyFrom(tensor_pb2.Tensor())
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        step = channel.unary_unary(f"/{SERVICE}/ApplyStep")
        for model in ("mnist_mlp", "no_such_model"):
            request = pb.StepRequest(model=model, learning_rate=0.1, batch=batch)
            with pytest.raises(grpc.RpcError) as err:
                step(request.SerializeToString(), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fields" in err.value.details()
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="no_such_model") == 0


def test_a_header_refused_before_parsing_is_counted_as_a_failed_update(
    fresh_server: RunningServer,
) -> None:
    """A SetWeights header of 60,000 specs is refused from its size, before any handler
    runs, and still counts for the model it names (not for one it does not)."""
    specs = [tensor_pb2.TensorSpec(name=f"t{i}", dtype=1, shape=[1]) for i in range(60_000)]
    with grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel:
        set_weights = channel.stream_unary(f"/{SERVICE}/SetWeights")
        for model in ("mnist_mlp", "no_such_model"):
            header = pb.WeightsHeader(model=model, tensors=specs)
            message = pb.WeightsMessage(header=header).SerializeToString()
            with pytest.raises(grpc.RpcError) as err:
                set_weights(iter([message]), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="no_such_model") == 0


def test_an_oversized_header_after_a_good_one_counts_the_update_once(
    fresh_server: RunningServer, fresh_client: GradientClient
) -> None:
    """A stream whose first header is good and whose next message is an oversized header
    is one failed update, counted once."""
    info = fresh_client.model_info("mnist_mlp")
    specs = [tensor_pb2.TensorSpec(name=v.name, dtype=1, shape=v.shape) for v in info.variables]
    good = pb.WeightsHeader(model="mnist_mlp", tensors=specs)
    many = [tensor_pb2.TensorSpec(name=f"t{i}", dtype=1, shape=[1]) for i in range(60_000)]
    bad = pb.WeightsHeader(model="mnist_mlp", tensors=many)
    messages = [pb.WeightsMessage(header=h).SerializeToString() for h in (good, bad)]
    with (
        grpc.insecure_channel(f"127.0.0.1:{fresh_server.port}") as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        channel.stream_unary(f"/{SERVICE}/SetWeights")(iter(messages), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _value(fresh_server, "pergrad_weights_update_failures_total", model="mnist_mlp") == 1


def test_gpu_memory_is_exported_only_when_tensorflow_sees_a_gpu(server: RunningServer) -> None:
    import tensorflow as tf

    names = sample_names(scrape(server.metrics_port))
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    assert ("pergrad_gpu_memory_used_bytes" in names) == has_gpu


def test_exposition_passes_promtool_check_metrics(
    server: RunningServer, client: GradientClient
) -> None:
    client.per_example_gradients("mnist_mlp", *_mlp_batch(2))
    run = promtool("check", "metrics", stdin=scrape(server.metrics_port))
    assert run.returncode == 0, run.stdout + run.stderr
