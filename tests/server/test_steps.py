"""ApplyStep on a live server through the real client: the weights after server-side steps
against the same steps done here (the oracle's per-example gradients, the proto's noise,
Keras's optimizer on local variables); all-or-nothing; pins; the optimizer's state."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.engine import VariableSpec
from pergrad.server.main import RunningServer, start
from pergrad.server.weights import weights_id
from tests import oracle, spec_random
from tests.helpers import KERAS_MODEL_NAME, assert_close, loopback_config
from tests.pauses import gated_server

MODEL = KERAS_MODEL_NAME
NOISE_STREAM = 2  # the proto's stream for CLIPPED_SUM noise
B, EXPECTED_B, LR, MAX_NORM, NOISE = 16, 20.0, 0.05, 0.5, 0.7


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's default dtypes, as a trainer has them."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, 12)), rng.integers(0, 5, B)


def _serving(model_dir: Path, optimizer: str) -> Callable[[], RunningServer]:
    return lambda: start(
        loopback_config(f"{MODEL}.keras", model_dir=model_dir, optimizer=optimizer)
    )


@pytest.fixture()
def serve(model_dir: Path) -> Iterator[Callable[[str], GradientClient]]:
    """serve(optimizer) -> a client of a server of its own with that --optimizer."""
    running: list[tuple[RunningServer, GradientClient]] = []

    def make(optimizer: str) -> GradientClient:
        server = _serving(model_dir, optimizer)()
        client = GradientClient(f"127.0.0.1:{server.port}", timeout=60)
        running.append((server, client))
        return client

    yield make
    for server, client in running:
        client.close()
        server.stop(0)


def _noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The proto's seeded Gaussian noise for variable `index`, from its written rule."""
    k = spec_random.key(seed, index, NOISE_STREAM)
    count = int(np.prod(shape))
    return np.array([spec_random.gaussian(k, n) for n in range(count)], np.float32).reshape(shape)


def _local_steps(
    model_dir: Path, optimizer: keras.optimizers.Optimizer, weights: dict, seeds: list[int]
) -> dict[str, np.ndarray]:
    """The DP-SGD steps done here: oracle per-example gradients at the current weights,
    clipped sum (float64, then float32), the proto's noise, / EXPECTED_B, Keras's
    optimizer on local variables."""
    model = keras.saving.load_model(model_dir / f"{MODEL}.keras")
    paths = [v.path for v in model.trainable_variables]
    local = [keras.Variable(weights[p]) for p in paths]
    optimizer.build(local)
    scale = np.float32(np.float32(NOISE) * np.float32(MAX_NORM))
    for seed in seeds:
        x, y = _batch(seed)
        current = {p: v.numpy() for p, v in zip(paths, local, strict=True)}
        _, grads = oracle.per_example(model, model.loss, x.astype(np.float32), y, weights=current)
        total = oracle.clipped_sum(grads, MAX_NORM)
        gradient = [
            (total[p].astype(np.float32) + scale * _noise(seed, i, total[p].shape))
            / np.float32(EXPECTED_B)
            for i, p in enumerate(paths)
        ]
        optimizer.learning_rate = LR
        optimizer.apply(gradient, local)
    return {p: v.numpy() for p, v in zip(paths, local, strict=True)}


def _dp_step(client: GradientClient, seed: int, **call):
    x, y = _batch(seed)
    return client.step(
        MODEL,
        x,
        y,
        learning_rate=call.pop("learning_rate", LR),
        expected_batch_size=EXPECTED_B,
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        seed=seed,
        **call,
    )


@pytest.mark.parametrize(
    ("flag", "optimizer"),
    [
        ("sgd:momentum=0.9", lambda: keras.optimizers.SGD(momentum=0.9)),
        ("adam:beta_1=0.8", lambda: keras.optimizers.Adam(beta_1=0.8)),
    ],
)
def test_server_steps_equal_the_same_steps_done_locally(
    serve, model_dir: Path, flag: str, optimizer: Callable
) -> None:
    client = serve(flag)
    _, start_weights = client.get_weights(MODEL)
    seeds = [3, 4, 5]
    results = [_dp_step(client, seed) for seed in seeds]
    version, served = client.get_weights(MODEL)
    assert [r.model_version for r in results] == [2, 3, 4] and version == 4
    assert_close(served, _local_steps(model_dir, optimizer(), start_weights, seeds))


def test_step_reports_losses_norms_and_clipped_counts_of_the_batch(serve, model_dir) -> None:
    client = serve("sgd")
    _, weights = client.get_weights(MODEL)
    step = _dp_step(client, 7)
    model = keras.saving.load_model(model_dir / f"{MODEL}.keras")
    x, y = _batch(7)
    losses, grads = oracle.per_example(model, model.loss, x.astype(np.float32), y, weights=weights)
    norms = oracle.per_example_norms(grads)
    assert_close({"losses": step.losses, "norms": step.norms}, {"losses": losses, "norms": norms})
    assert step.num_clipped == int(np.sum(norms > MAX_NORM))
    assert step.weights_id == client.model_info(MODEL).weights_id


def test_the_reported_gradient_norm_is_the_applied_gradients(serve) -> None:
    """||(clipped sum + noise) / expected_batch_size||: the clipped_sum of the same batch,
    seed and weights is the sum the step divides and applies."""
    client = serve("sgd")
    x, y = _batch(9)
    total = client.per_example_gradients(
        MODEL,
        x,
        y,
        reduction="clipped_sum",
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        seed=9,
        model_version=client.model_info(MODEL).model_version,
    ).clipped_sum
    step = _dp_step(client, 9)
    applied = [(t / np.float32(EXPECTED_B)).astype(np.float64) for t in total.values()]
    assert step.gradient_norm == pytest.approx(np.sqrt(sum(np.sum(a * a) for a in applied)))


def test_a_step_pinned_to_other_weights_by_content_is_refused(serve) -> None:
    """The compare-and-swap holds by content too: the current version with another
    weights_id (the same version number after a restart) changes nothing."""
    client = serve("sgd")
    before = client.model_info(MODEL)
    x, y = _batch(12)
    with pytest.raises(PergradError) as refused:
        client.step(
            MODEL,
            x,
            y,
            learning_rate=LR,
            max_norm=MAX_NORM,
            model_version=before.model_version,
            weights_id="0" * 32,
        )
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "weights_id" in refused.value.message
    after = client.model_info(MODEL)
    assert (after.model_version, after.weights_id) == (before.model_version, before.weights_id)


def test_a_step_sent_in_parts_divides_by_the_expected_batch_size(model_dir: Path) -> None:
    """A batch over the server's --max-batch is computed in parts and its sum applied
    once: divided by the caller's expected batch size, as a step sent whole is."""
    whole, parts = (
        start(loopback_config(f"{MODEL}.keras", model_dir=model_dir, max_batch=limit))
        for limit in (4096, B // 2)
    )
    try:
        after = []
        for running in (whole, parts):
            with GradientClient(f"127.0.0.1:{running.port}", timeout=60) as client:
                _dp_step(client, 13)
                after.append(client.get_weights(MODEL)[1])
    finally:
        whole.stop(0)
        parts.stop(0)
    assert_close(after[1], after[0])


def test_a_lone_step_is_admitted_as_the_same_batchs_gradients_call_is() -> None:
    """--max-inflight-bytes 1000000, a caller's calls holding half of it at most: 64
    examples of mnist_mlp make a request of 201 kB and a clipped sum of 407 kB, which a
    lone call may hold together, its own request not counted as another call's. The
    gradients call and the step of that batch are both served (before: the step's own
    request was counted against its caller's half, and the step alone was refused)."""
    running = start(loopback_config("mnist_mlp", max_inflight_bytes=1_000_000))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 784)).astype(np.float32), rng.integers(0, 10, 64)
    try:
        with GradientClient(f"127.0.0.1:{running.port}", timeout=60) as client:
            total = client.per_example_gradients(
                "mnist_mlp", x, y, reduction="clipped_sum", max_norm=MAX_NORM
            )
            step = client.step("mnist_mlp", x, y, learning_rate=LR, max_norm=MAX_NORM)
    finally:
        running.stop(0)
    assert sum(a.nbytes for a in total.clipped_sum.values()) > 400_000
    assert step.model_version == 2 and step.num_clipped == total.num_clipped


def test_a_step_reports_how_far_it_moved_each_variable(serve) -> None:
    client = serve("sgd")
    _, before = client.get_weights(MODEL)
    step = _dp_step(client, 11)
    _, after = client.get_weights(MODEL)
    moved = {name: float(np.linalg.norm(after[name] - before[name])) for name in before}
    assert step.update_norms.keys() == moved.keys() and step.unmoved == []
    for name, distance in moved.items():
        assert step.update_norms[name] == pytest.approx(distance, rel=1e-5, abs=1e-8)


def test_a_moments_step_applies_the_plain_mean_gradient(serve, model_dir) -> None:
    client = serve("sgd")
    _, weights = client.get_weights(MODEL)
    x, y = _batch(8)
    step = client.step(MODEL, x, y, learning_rate=LR, reduction="moments")
    model = keras.saving.load_model(model_dir / f"{MODEL}.keras")
    _, grads = oracle.per_example(model, model.loss, x.astype(np.float32), y, weights=weights)
    expected = {p: weights[p] - LR * g.mean(axis=0) for p, g in grads.items()}
    assert step.norms is None and step.num_clipped == 0
    assert_close(client.get_weights(MODEL)[1], expected)


def test_set_weights_starts_the_optimizer_afresh(serve) -> None:
    """With momentum, a second step differs from a first; after SetWeights of the
    starting weights, the same step gives the first step's weights again."""
    client = serve("sgd:momentum=0.9")
    _, start_weights = client.get_weights(MODEL)
    _dp_step(client, 1)
    _, first = client.get_weights(MODEL)
    client.set_weights(MODEL, start_weights)
    _dp_step(client, 1)
    np.testing.assert_array_equal(client.get_weights(MODEL)[1]["head/kernel"], first["head/kernel"])


def test_a_step_pinned_to_an_old_version_changes_nothing(serve) -> None:
    client = serve("sgd")
    _dp_step(client, 1)
    before = client.model_info(MODEL)
    with pytest.raises(PergradError) as refused:
        _dp_step(client, 2, model_version=1)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    after = client.model_info(MODEL)
    assert (after.model_version, after.weights_id) == (before.model_version, before.weights_id)


def test_a_step_that_fails_leaves_weights_and_optimizer_state_as_they_were(serve) -> None:
    """A step whose gradient overflows float32 (a sum divided by a tiny expected batch size)
    is refused after the optimizer ran: the next step then gives what it gives on a
    server that never saw the failed one."""
    failing, control = serve("sgd:momentum=0.9"), serve("sgd:momentum=0.9")
    for client in (failing, control):
        _dp_step(client, 1)
    x, y = _batch(2)
    with pytest.raises(PergradError) as refused:
        failing.step(MODEL, x, y, learning_rate=LR, expected_batch_size=1e-45, max_norm=1.0)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "nothing was changed" in refused.value.message
    assert failing.model_info(MODEL).model_version == 2
    for client in (failing, control):
        _dp_step(client, 3)
    assert failing.model_info(MODEL).weights_id == control.model_info(MODEL).weights_id


def test_a_step_that_would_overflow_the_optimizers_state_is_refused(serve) -> None:
    """Adam's second moment of a gradient of ~1e24 overflows float32 while the weights
    stay finite (the update divides by it): refused, or every later step would be NaN."""
    client = serve("adam")
    before = client.model_info(MODEL).weights_id
    x, y = _batch(3)
    with pytest.raises(PergradError) as refused:
        client.step(MODEL, x, y, learning_rate=LR, reduction="moments", expected_batch_size=1e-24)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the optimizer's state NaN or infinite" in refused.value.message
    assert client.model_info(MODEL).weights_id == before
    _dp_step(client, 4)  # and the model still steps


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"learning_rate": float("nan")}, "learning_rate: a finite number > 0"),
        ({"learning_rate": -0.1}, "learning_rate: a finite number > 0"),
        ({"learning_rate": 1e39}, "learning_rate: a finite number > 0 (float32)"),
        ({"learning_rate": 1e-46}, "learning_rate: a finite number > 0 (float32)"),
        ({"expected_batch_size": float("inf")}, "expected_batch_size: a finite number > 0"),
        ({"reduction": "norms", "max_norm": None}, "a step applies ['clipped_sum', 'moments']"),
        ({"variables": ["head/bias"]}, "a step updates every variable"),
        ({"max_norm": -1.0}, "max_norm"),
    ],
)
def test_bad_steps_are_invalid_argument_and_change_nothing(serve, call, message) -> None:
    client = serve("sgd")
    before = client.model_info(MODEL).weights_id
    x, y = _batch(0)
    options = {"learning_rate": LR, "max_norm": MAX_NORM} | call
    options = {key: value for key, value in options.items() if value is not None}
    with pytest.raises(PergradError) as refused:
        client.step(MODEL, x, y, **options)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.message
    assert client.model_info(MODEL).weights_id == before


def test_model_info_names_the_optimizer_and_its_settings(serve) -> None:
    info = serve("adam:beta_1=0.8,amsgrad=true").model_info(MODEL)
    assert info.optimizer.startswith("Adam(") and "beta_1=0.8" in info.optimizer
    assert "amsgrad=True" in info.optimizer


def test_model_info_names_the_keras_whose_optimizer_steps_apply(serve) -> None:
    """Adam's arithmetic is Keras's choice (bias correction, epsilon): ModelInfo names the
    Keras version the optimizer class is of, the one the server runs."""
    assert serve("adam").model_info(MODEL).keras_version == keras.__version__


def test_weights_read_during_steps_are_always_a_whole_step(serve) -> None:
    """GetWeights racing steps: each version read is exactly the weights that step made
    (its weights_id recomputed here from the bytes read)."""
    client = serve("sgd:momentum=0.5")
    info = client.model_info(MODEL)
    specs = [
        VariableSpec(i, v.name, np.dtype(v.dtype), tuple(v.shape))
        for i, v in enumerate(info.variables)
    ]
    made: dict[int, str] = {info.model_version: info.weights_id}
    done = threading.Event()

    def train() -> None:
        try:
            for seed in range(12):
                step = _dp_step(client, seed)
                made[step.model_version] = step.weights_id
        finally:
            done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    seen: list[tuple[int, str]] = []
    while not done.is_set():
        version, weights = client.get_weights(MODEL)
        seen.append((version, weights_id(specs, [weights[s.name] for s in specs])))
    trainer.join()
    assert len(made) == 13
    assert all(made[version] == identity for version, identity in seen), seen


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({}, "set exactly one of batch and gradient_sum"),
        ({"batch": {"reduction": "REDUCTION_NORMS"}}, "a step applies ['clipped_sum', 'moments']"),
        (
            {"batch": {"model": MODEL, "reduction": "REDUCTION_MOMENTS"}},
            "['model'] are the step's own",
        ),
        ({"gradient_sum": {"nope": [1.0]}}, "expected_batch_size: required with gradient_sum"),
        (
            {"gradient_sum": {"nope": [1.0]}, "expected_batch_size": 4},
            "weights must name every trainable variable once",
        ),
    ],
)
def test_malformed_step_requests_are_invalid_argument(serve, step: dict, message: str) -> None:
    """What the client never sends, sent raw: the server refuses it by itself."""
    from google.protobuf import json_format

    from pergrad.v1 import gradient_service_pb2 as pb
    from pergrad.wire.codec import encode_tensor

    client = serve("sgd")
    x, y = _batch(0)
    request = pb.StepRequest(model=MODEL, learning_rate=LR)
    if "batch" in step:
        request.batch.inputs.CopyFrom(encode_tensor(x.astype(np.float32)))
        request.batch.labels.CopyFrom(encode_tensor(y.astype(np.int32)))
        json_format.ParseDict(step["batch"], request.batch)
    for name, values in step.get("gradient_sum", {}).items():
        request.gradient_sum[name].CopyFrom(encode_tensor(np.asarray(values, np.float32)))
    request.expected_batch_size = step.get("expected_batch_size", 0)
    channel = grpc.insecure_channel(client.replicas[0])
    with pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary(
            "/pergrad.v1.GradientService/ApplyStep",
            request_serializer=pb.StepRequest.SerializeToString,
            response_deserializer=pb.StepResponse.FromString,
        )(request, timeout=30)
    channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.details()


def test_set_weights_during_a_step_refuses_the_step_and_get_weights_sees_no_part_of_it() -> None:
    """A step's pass held at a gate: meanwhile GetWeights reads the weights the step
    started from, and a SetWeights lands; the step then applies nothing
    (FAILED_PRECONDITION), and the SetWeights' weights stay."""
    gate, running = gated_server()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)
    try:
        with GradientClient(f"127.0.0.1:{running.port}", timeout=60) as client:
            _, start_weights = client.get_weights("gated")
            doubled = {name: 2 * w for name, w in start_weights.items()}
            with ThreadPoolExecutor(1) as pool, gate.closed():
                step = pool.submit(client.step, "gated", x, y, learning_rate=0.1, max_norm=1.0)
                assert gate.entered.acquire(timeout=60), "the step's pass never began"
                version, during = client.get_weights("gated")
                assert version == 1
                np.testing.assert_array_equal(during["head/kernel"], start_weights["head/kernel"])
                assert client.set_weights("gated", doubled) == 2
            with pytest.raises(PergradError) as refused:
                step.result(timeout=60)
            version, after = client.get_weights("gated")
    finally:
        running.stop(0)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the weights changed during the step" in refused.value.message
    assert version == 2
    np.testing.assert_array_equal(after["head/kernel"], doubled["head/kernel"])
