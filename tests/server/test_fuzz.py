"""Random, malformed, truncated and resource-shaped requests, idle streams, and silent
callers with any token, against a live server: every answer is a deliberate status
(never UNKNOWN or INTERNAL), every OK answer a whole result of the shapes the request
implies with finite values, and the server stays healthy and answering.

`PERGRAD_FUZZ_EXAMPLES` sets how many requests of each kind (`make soak` runs thousands).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pergrad.client import GradientClient
from pergrad.server.main import RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunks import decode_response
from pergrad.wire.codec import TensorAssembler, encode_tensor
from pergrad.wire.messages import gradients_request, parse_request
from pergrad.wire.results import expected_outputs
from tests.helpers import OPEN_METHODS, loopback_config, open_call

EXAMPLES = int(os.environ.get("PERGRAD_FUZZ_EXAMPLES", "150"))
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SERVICE = "/pergrad.v1.GradientService/"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

dims = st.lists(st.integers(-2, 900), max_size=4)
tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.integers(0, 12),
    shape=dims,
    content=st.binary(max_size=4096),
)
# Sometimes a tensor that is right for mnist_mlp, so the checks past decoding run too.
good_inputs = st.integers(1, 4).map(
    lambda b: tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[b, 784], content=b"\0" * (b * 784 * 4)
    )
)
requests = st.builds(
    pb.GradientsRequest,
    model=st.sampled_from(["mnist_mlp", "mnist_cnn", "", "nope", "../x"]),
    model_version=st.integers(-3, 3),
    inputs=st.one_of(tensors, good_inputs),
    labels=tensors,
    reduction=st.integers(0, 7),
    variables=st.lists(st.sampled_from(["hidden/bias", "logits/kernel", "zz"]), max_size=3),
    max_norm=st.floats(allow_nan=True, allow_infinity=True),
    dim=st.integers(0, 1 << 20),
    wire_dtype=st.integers(0, 12),
)


def _call(server: RunningServer, method: str, payload, *, streaming_request: bool = False):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        if streaming_request:
            call = channel.stream_unary(SERVICE + method)
            return call(iter(payload), timeout=30)
        call = channel.unary_stream(SERVICE + method)
        return list(call(payload, timeout=30))


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


Variables = dict[str, list[tuple[str, tuple[int, ...]]]]


@pytest.fixture(scope="module")
def variables(server: RunningServer) -> Variables:
    """(name, shape) of every variable of every served model, in model order."""
    with GradientClient(f"127.0.0.1:{server.port}") as client:
        return {
            model: [(v.name, v.shape) for v in client.model_info(model).variables]
            for model in client.list_models()
        }


def _decoded(replies: list[bytes]) -> tuple[pb.ResultHeader, list[np.ndarray]]:
    """The one result the replies carry: its header and its tensors, every byte arrived."""
    header, *chunks = [decode_response(reply) for reply in replies]
    assert header.header is not None and all(part.chunk is not None for part in chunks)
    assembler = TensorAssembler([o.tensor for o in header.header.outputs])
    if header.header.data:  # a small result inline (`inline_result`): no chunks follow
        assert not chunks
        assembler.add_inline(header.header.data)
    for part in chunks:
        assembler.add_raw(*part.chunk)
    return header.header, assembler.arrays()


def _check_ok_result(variables: Variables, data: bytes, replies: list[bytes]) -> None:
    """The result of the request `data` holds exactly the tensors it implies (fields,
    variables, shapes), each finite."""
    request = pb.GradientsRequest.FromString(data)
    asked = parse_request(request)
    inputs = [request.inputs] if request.HasField("inputs") else request.named_inputs.values()
    batch = next(iter(inputs)).shape[0]
    model = variables[request.model]
    selected = asked.variables or [name for name, _ in model]
    chosen = [(name, shape) for name, shape in model if name in selected]
    want = expected_outputs(asked.reduction, batch=batch, variables=chosen, options=asked.options)
    header, arrays = _decoded(replies)
    assert header.batch_size == batch
    got = [(o.field, o.tensor.name, tuple(o.tensor.shape)) for o in header.outputs]
    assert got == [(e.field, e.variable, e.shape) for e in want]
    for output, array in zip(header.outputs, arrays, strict=True):
        assert array.shape == tuple(output.tensor.shape)
        assert np.isfinite(array.astype(np.float64)).all(), (output.field, output.tensor.name)


def _check_gradients_call(
    server: RunningServer, variables: Variables, data: bytes
) -> grpc.StatusCode:
    """A deliberate status; with OK, a whole and finite result of the implied shapes."""
    replies: list[bytes] = []
    code = _code(lambda: replies.extend(_call(server, "ComputePerExampleGradients", data)))
    assert code not in BAD_CODES
    event(f"status {code.name}")  # --hypothesis-show-statistics: how often OK is checked
    if code == grpc.StatusCode.OK:
        _check_ok_result(variables, data, replies)
    return code


@FUZZ
@given(request=requests)
def test_random_gradient_requests_get_deliberate_codes(server, variables, request) -> None:
    _check_gradients_call(server, variables, request.SerializeToString())


MLP = {v.path: tuple(v.shape) for v in BUILTIN_MODELS["mnist_mlp"]().trainable_variables}


def _choices(reduction: str, option: str) -> st.SearchStrategy[str]:
    (found,) = [o for o in CATALOGUE.get(reduction).options if o.name == option]
    return st.sampled_from(found.choices)


SEEDS = st.integers(0, 2**64 - 1)
# Options in their documented ranges; max_norm and noise_multiplier bounded so that the
# noise's std fits float32. DOT's reference is made per request; a reduction not named
# here takes no options.
OPTIONS = {
    "none": st.fixed_dictionaries({}, optional={"wire_dtype": _choices("none", "wire_dtype")}),
    "clipped_sum": st.fixed_dictionaries(
        {"max_norm": st.floats(1e-6, 1e6)},
        optional={"noise_multiplier": st.floats(0, 100), "seed": SEEDS},
    ),
    "project": st.fixed_dictionaries(
        {"dim": st.integers(1, 512)},
        optional={"seed": SEEDS, "projection": _choices("project", "projection")},
    ),
}


@st.composite
def plausible_requests(draw: st.DrawFn) -> pb.GradientsRequest:
    """What a careful client may send mnist_mlp: any reduction, options in range, any
    subset of the variables, inputs of any scale from 0 to 1e3."""
    size, seed = draw(st.integers(1, 8)), draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 1e3]))
    x = (scale * rng.standard_normal((size, 784))).astype(np.float32)
    y = rng.integers(0, 10, size).astype(np.int32)
    variables = draw(st.lists(st.sampled_from(sorted(MLP)), unique=True))
    reduction = draw(st.sampled_from(sorted(CATALOGUE.reductions)))
    options = draw(OPTIONS.get(reduction, st.just({})))
    if reduction == "dot":
        rows = draw(st.integers(1, 8))
        options["reference"] = {
            name: rng.standard_normal((rows, *MLP[name])) for name in variables or MLP
        }
    entry = CATALOGUE.get(reduction)
    return gradients_request(
        "mnist_mlp", x, y, reduction=entry, options=options, variables=variables
    ).inline()


@FUZZ
@given(request=plausible_requests())
def test_plausible_requests_get_whole_finite_results(server, variables, request) -> None:
    code = _check_gradients_call(server, variables, request.SerializeToString())
    assert code == grpc.StatusCode.OK


@FUZZ
@given(data=st.binary(max_size=2048))
def test_garbage_bytes_get_deliberate_codes(server, variables, data: bytes) -> None:
    _check_gradients_call(server, variables, data)


@FUZZ
@given(request=requests, cut=st.integers(0, 2000))
def test_truncated_requests_get_deliberate_codes(server, variables, request, cut) -> None:
    _check_gradients_call(server, variables, request.SerializeToString()[:cut])


weights_messages = st.lists(
    st.one_of(
        st.builds(
            pb.WeightsMessage,
            header=st.builds(
                pb.WeightsHeader,
                model=st.sampled_from(["mnist_cnn", "x"]),
                model_version=st.integers(-1, 3),
                tensors=st.lists(
                    st.builds(
                        tensor_pb2.TensorSpec,
                        name=st.text(max_size=12),
                        dtype=st.integers(0, 9),
                        shape=dims,
                    ),
                    max_size=3,
                ),
            ),
        ),
        st.builds(
            pb.WeightsMessage,
            chunk=st.builds(
                tensor_pb2.TensorChunk,
                tensor=st.integers(0, 9),
                offset=st.integers(0, 1 << 40),
                data=st.binary(max_size=512),
            ),
        ),
    ),
    max_size=5,
).map(lambda messages: [m.SerializeToString() for m in messages])


@FUZZ
@given(messages=st.one_of(weights_messages, st.lists(st.binary(max_size=64), max_size=3)))
def test_random_set_weights_streams_get_deliberate_codes(server: RunningServer, messages) -> None:
    code = _code(lambda: _call(server, "SetWeights", messages, streaming_request=True))
    assert code not in BAD_CODES


@FUZZ
@given(
    method=st.sampled_from(OPEN_METHODS),
    data=st.one_of(st.binary(max_size=64), st.integers(4000, 20_000).map(bytes)),
)
def test_random_requests_to_open_services_get_deliberate_codes(server, method, data) -> None:
    """Garbage, and requests around OPEN_REQUEST_BYTES, no token: a Watch is left after
    its first reply."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = open_call(channel, *method, data)
        code = _code(lambda: next(call, None))
        call.cancel()
    assert code not in BAD_CODES
    event(f"status {code.name}")


def test_server_is_serving_after_the_fuzzing(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# Resource-shaped requests: many reference rows, large projections, a new seed every time,
# all on a small variable so each stays cheap to compute when it is admitted.
resource_requests = st.builds(
    lambda reduction, batch, k, dim, seed: _resource_request(reduction, batch, k, dim, seed),
    reduction=st.sampled_from(["dot", "project", "clipped_sum"]),
    batch=st.integers(1, 64),
    k=st.integers(1, 200_000),
    dim=st.integers(1, 1 << 17),
    seed=st.integers(0, 2**64 - 1),
)


def _resource_request(reduction: str, batch: int, k: int, dim: int, seed: int):
    x = np.zeros((batch, 784), np.float32)
    request = pb.GradientsRequest(
        model="mnist_mlp",
        inputs=encode_tensor(x),
        labels=encode_tensor(np.zeros(batch, np.int32)),
        reduction=pb.Reduction.Value(f"REDUCTION_{reduction.upper()}"),
        variables=["logits/bias"],
    )
    if reduction == "dot":
        request.reference["logits/bias"].CopyFrom(encode_tensor(np.ones((k, 10), np.float32)))
    elif reduction == "project":
        request.dim, request.seed = dim, seed
    else:
        request.max_norm, request.noise_multiplier, request.seed = 1.0, 1.0, seed
    return request


@FUZZ
@given(request=resource_requests)
def test_resource_shaped_requests_get_deliberate_codes(server, variables, request) -> None:
    _check_gradients_call(server, variables, request.SerializeToString())


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[RunningServer]:
    running = start(loopback_config("mnist_mlp", workers=3, max_streams=2, stall_timeout_s=1.0))
    yield running
    running.stop(0)


STREAM_METHODS = [
    SERVICE + "StreamPerExampleGradients",
    SERVICE + "SetWeights",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.health.v1.Health/Watch",
]


def _silent_calls(
    channel: grpc.Channel, calls: list[tuple[str, tuple | None]], never: threading.Event
) -> list[grpc.Future]:
    """Each (method, metadata) called with a request stream that sends nothing until
    `never` is set (a Watch: its one request, and its replies never read)."""

    def nothing() -> Iterator[bytes]:
        never.wait()
        yield b""

    return [
        channel.unary_stream(method)(
            health_pb2.HealthCheckRequest().SerializeToString(), metadata=metadata
        )
        if method.endswith("Watch")
        else channel.stream_stream(method)(nothing(), metadata=metadata)
        for method, metadata in calls
    ]


@settings(
    max_examples=max(5, EXAMPLES // 15), deadline=None, suppress_health_check=list(HealthCheck)
)
@given(methods=st.lists(st.sampled_from(STREAM_METHODS), min_size=1, max_size=12))
def test_idle_streams_of_any_kind_leave_the_server_answering(guarded_server, methods) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{guarded_server.port}") as channel:
        never = threading.Event()
        opened = _silent_calls(channel, [(m, None) for m in methods], never)
        reply = channel.unary_unary(SERVICE + "ListModels")(
            pb.ListModelsRequest().SerializeToString(), timeout=10
        )
        assert pb.ListModelsResponse.FromString(reply).models == ["mnist_mlp"]
        never.set()
        for call in opened:
            call.cancel()


@pytest.fixture(scope="module")
def tokened_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tokens = tmp_path_factory.mktemp("fuzz") / "tokens"
    tokens.write_text("secret\nreader:ro\n")
    config = loopback_config(
        "mnist_mlp",
        workers=3,
        max_streams=2,
        max_queued_calls=4,
        stall_timeout_s=1.0,
        auth_token_file=tokens,
    )
    running = start(config)
    yield running
    running.stop(0)


ONE_REQUEST_METHODS = [
    SERVICE + "GetModelInfo",
    SERVICE + "ComputePerExampleGradients",
    "/grpc.health.v1.Health/Check",
]
PRESENTED = {
    "no token": None,
    "wrong token": (("authorization", "Bearer guess"),),
    "read-only token": (("authorization", "Bearer reader"),),
}
HONEST = (("authorization", "Bearer secret"),)
silent_calls = st.tuples(
    st.sampled_from(STREAM_METHODS + ONE_REQUEST_METHODS), st.sampled_from(sorted(PRESENTED))
)


@settings(
    max_examples=max(5, EXAMPLES // 15), deadline=None, suppress_health_check=list(HealthCheck)
)
@given(attacks=st.lists(silent_calls, min_size=1, max_size=16))
def test_silent_callers_with_any_token_leave_another_tokens_calls_answering(
    tokened_server, attacks
) -> None:
    """Calls that never send (or never end) their requests, to any method, with no token,
    a wrong one or a read-only one: another token's calls and a health probe still answer."""
    with grpc.insecure_channel(f"127.0.0.1:{tokened_server.port}") as channel:
        never = threading.Event()
        calls = [(method, PRESENTED[token]) for method, token in attacks]
        opened = _silent_calls(channel, calls, never)
        event(f"{len(attacks)} silent calls")
        reply = channel.unary_unary(SERVICE + "ListModels")(
            pb.ListModelsRequest().SerializeToString(), metadata=HONEST, timeout=10
        )
        assert pb.ListModelsResponse.FromString(reply).models == ["mnist_mlp"]
        # The probe on a connection of its own, as a kubelet's comes: on the silent
        # callers' own, past half the open services' places, it is refused by design
        # (and was, whenever the silent calls were all admitted before it: a busy machine).
        with grpc.insecure_channel(
            f"127.0.0.1:{tokened_server.port}", options=[("grpc.use_local_subchannel_pool", 1)]
        ) as probe_channel:
            probe = health_pb2_grpc.HealthStub(probe_channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
        never.set()
        for call in opened:
            call.cancel()
