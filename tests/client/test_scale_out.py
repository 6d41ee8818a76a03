"""Several real servers behind one client: spread, ordered, resilient, consistent.

Each replica is a real gRPC server on 127.0.0.1: started in this process where a test
only talks to it, a process of its own where a test kills one.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, MixedPlansWarning, PergradError
from pergrad.server.main import start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from tests import oracle
from tests.helpers import (
    assert_close,
    batch_for,
    connect_both,
    loopback_config,
    spawn_server,
    stop_server,
)
from tests.pauses import gated_server

MODEL = "mnist_cnn"
FLAGS = ("--model", MODEL, "--jit-compile", "off")


def _servers(count: int) -> Iterator[list[str]]:
    """`count` in-process servers named r0, r1, ...: their targets, then they stop."""
    running = [start(loopback_config(MODEL, replica_name=f"r{i}")) for i in range(count)]
    yield [f"127.0.0.1:{server.port}" for server in running]
    for server in running:
        server.stop(0)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    """Three replicas for tests that leave the weights alone."""
    yield from _servers(3)


@pytest.fixture()
def own_replicas() -> Iterator[list[str]]:
    """Two replicas a test may change."""
    yield from _servers(2)


@pytest.fixture()
def processes() -> Iterator[list[tuple[object, str]]]:
    """Two replica processes, started side by side, for a test that kills one."""
    with ThreadPoolExecutor(2) as pool:
        started = list(
            pool.map(lambda i: spawn_server(*FLAGS, "--replica-name", f"r{i}"), range(2))
        )
    yield started
    for process, _ in started:
        stop_server(process)


def _many(targets: list[str]) -> str:
    return "ipv4:" + ",".join(targets)


def test_micro_batches_spread_over_replicas_and_match_one_server(replicas: list[str]) -> None:
    x, y = batch_for((28, 28, 1), 10, 10, seed=1)
    with GradientClient(replicas[0]) as one:
        expected = one.per_example_gradients(MODEL, x, y)
    with GradientClient(_many(replicas), micro_batch=2) as many:
        connect_both(many, MODEL, x, y)
        result = many.per_example_gradients(MODEL, x, y)
    assert len(set(result.server.split(","))) >= 2, result.server
    assert_close({"losses": result.losses}, {"losses": expected.losses})
    assert_close(result.gradients, expected.gradients)


def test_reductions_merge_like_one_batch(replicas: list[str]) -> None:
    x, y = batch_for((28, 28, 1), 10, 9, seed=2)
    options = {"reduction": "clipped_sum", "max_norm": 0.5, "noise_multiplier": 1.0, "seed": 3}
    with GradientClient(replicas[0]) as one:
        expected = one.per_example_gradients(MODEL, x, y, **options)
    with GradientClient(_many(replicas), micro_batch=4) as many:
        connect_both(many, MODEL, x, y)
        result = many.per_example_gradients(MODEL, x, y, **options)
    assert "," in result.server
    assert result.num_clipped == expected.num_clipped
    assert_close(result.clipped_sum, expected.clipped_sum)
    assert_close({"norms": result.norms}, {"norms": expected.norms})


def test_micro_batches_over_replicas_match_keras_oracle(replicas: list[str]) -> None:
    """Gradients and a clipped sum (bound between the median oracle norm and the next)
    assembled from micro-batches on several replicas."""
    x, y = batch_for((28, 28, 1), 10, 9, seed=3)
    losses, grads = oracle.per_example(BUILTIN_MODELS[MODEL](), LOSS, x, y)
    norms = oracle.per_example_norms(grads)
    middle = len(norms) // 2
    max_norm = float(np.mean(np.sort(norms)[middle : middle + 2]))
    with GradientClient(_many(replicas), micro_batch=2) as many:
        connect_both(many, MODEL, x, y)
        full = many.per_example_gradients(MODEL, x, y)
        clipped = many.per_example_gradients(
            MODEL, x, y, reduction="clipped_sum", max_norm=max_norm
        )
    assert_close({"losses": full.losses}, {"losses": losses})
    assert_close(full.gradients, grads)
    assert clipped.num_clipped == int(np.sum(norms > max_norm)) == len(x) // 2
    assert_close({"norms": clipped.norms}, {"norms": norms})
    assert_close(clipped.clipped_sum, oracle.clipped_sum(grads, max_norm))


def test_stream_over_replicas_keeps_the_order(replicas: list[str]) -> None:
    batches = [batch_for((28, 28, 1), 10, size, seed=size) for size in (3, 1, 4, 2, 5, 1)]
    with GradientClient(_many(replicas), max_in_flight=3) as many:
        connect_both(many, MODEL, *batches[0])
        results = list(many.stream(MODEL, batches, reduction="norms"))
        servers = {r.server for r in results}
        singles = [many.per_example_gradients(MODEL, x, y, reduction="norms") for x, y in batches]
    assert [r.batch_size for r in results] == [3, 1, 4, 2, 5, 1]
    assert len(servers) >= 2
    for got, want in zip(results, singles, strict=True):
        assert_close({"n": got.norms}, {"n": want.norms})


def test_call_completes_when_a_replica_is_killed_mid_stream(processes) -> None:
    (victim, _), _ = processes
    batches = [batch_for((28, 28, 1), 10, 64, seed=i) for i in range(12)]
    with GradientClient(_many([t for _, t in processes]), max_in_flight=2) as many:
        results = []
        for result in many.stream(MODEL, iter(batches)):
            results.append(result)
            if len(results) == 2:
                victim.kill()
    assert [r.batch_size for r in results] == [64] * 12
    survivor = processes[1][1]
    with GradientClient(survivor) as one:
        last = one.per_example_gradients(MODEL, *batches[-1])
    assert_close(results[-1].gradients, last.gradients)


def _closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_unavailable_only_when_no_replica_is_left() -> None:
    x, y = batch_for((28, 28, 1), 10, 2)
    targets = _many([_closed_port(), _closed_port()])
    with GradientClient(targets, timeout=10) as many, pytest.raises(PergradError) as err:
        many.per_example_gradients(MODEL, x, y)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_set_weights_gives_every_replica_the_same_version(own_replicas) -> None:
    targets = own_replicas
    with GradientClient(targets[0]) as first:
        version, weights = first.get_weights(MODEL)
        first.set_weights(MODEL, weights)  # replica 0 is now one version ahead
    with GradientClient(_many(targets)) as many:
        new_version = many.set_weights(MODEL, {k: w * 2 for k, w in weights.items()})
    assert new_version == version + 2
    for target in targets:
        with GradientClient(target) as one:
            got_version, got = one.get_weights(MODEL)
        assert got_version == new_version
        np.testing.assert_array_equal(got["logits/bias"], weights["logits/bias"] * 2)


def test_replicas_on_different_plans_warn() -> None:
    """One replica with XLA, one without: a micro-batched result from both warns once."""
    model = "mnist_mlp"  # XLA compiles it in a fraction of mnist_cnn's time
    running = [
        start(loopback_config(model, replica_name="r0", jit_compile="off")),
        start(loopback_config(model, replica_name="r1", jit_compile="on")),
    ]
    x, y = batch_for((784,), 10, 8)
    try:
        targets = [f"127.0.0.1:{server.port}" for server in running]
        with (
            GradientClient(_many(targets), micro_batch=1) as many,
            pytest.warns(MixedPlansWarning, match="different plans"),
        ):
            connect_both(many, model, x, y)
            result = many.per_example_gradients(model, x, y, reduction="norms")
    finally:
        for server in running:
            server.stop(0)
    assert len(result.plan_id.split(",")) == 2


def test_result_mixing_weights_versions_is_refused(own_replicas) -> None:
    targets = own_replicas
    with GradientClient(targets[0]) as first:
        _, weights = first.get_weights(MODEL)
        first.set_weights(MODEL, weights)
    x, y = batch_for((28, 28, 1), 10, 8)
    with GradientClient(_many(targets), micro_batch=1) as many:
        connect_both(many, MODEL, x, y)  # one example: one replica, one version
        with pytest.raises(PergradError) as err:
            many.per_example_gradients(MODEL, x, y)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "r0 v2" in err.value.message and "r1 v1" in err.value.message


@pytest.fixture()
def trained_replicas() -> Iterator[list[str]]:
    """Two mnist_mlp replicas stepping with momentum, whose state a step must carry."""
    running = [
        start(loopback_config("mnist_mlp", replica_name=f"r{i}", optimizer="sgd:momentum=0.9"))
        for i in range(2)
    ]
    yield [f"127.0.0.1:{server.port}" for server in running]
    for server in running:
        server.stop(0)


def _step(client: GradientClient, model: str, x: np.ndarray, y: np.ndarray, seed: int):
    return client.step(
        model, x, y, learning_rate=0.1, max_norm=1.0, noise_multiplier=1.0, seed=seed
    )


def test_steps_leave_every_replica_on_the_same_weights_version_and_state(
    trained_replicas,
) -> None:
    """Micro-batches spread over both; after the steps, each replica stepped alone once
    more with the same batch gives the same weights: their momentum agrees too."""
    x, y = batch_for((784,), 10, 64)
    with GradientClient(_many(trained_replicas), micro_batch=16) as many:
        connect_both(many, "mnist_mlp", x, y)
        steps = [_step(many, "mnist_mlp", x, y, seed) for seed in range(3)]
    assert [s.model_version for s in steps] == [2, 3, 4]
    assert set(steps[-1].server.split(",")) == {"r0", "r1"}
    after = []
    for target in trained_replicas:
        with GradientClient(target) as one:
            info = one.model_info("mnist_mlp")
            assert (info.model_version, info.weights_id) == (4, steps[-1].weights_id)
            after.append(_step(one, "mnist_mlp", x, y, seed=9).weights_id)
    assert after[0] == after[1]


def test_replicas_whose_optimizer_states_differ_are_found_out(trained_replicas) -> None:
    """One replica stepped alone, the other set to its weights (a fresh state): a step on
    both makes different weights under one version, and says so."""
    x, y = batch_for((784,), 10, 16)
    with GradientClient(trained_replicas[0]) as first:
        _step(first, "mnist_mlp", x, y, seed=1)
        _, weights = first.get_weights("mnist_mlp")
    with GradientClient(trained_replicas[1]) as second:
        second.set_weights("mnist_mlp", weights)
    with (
        GradientClient(_many(trained_replicas)) as many,
        pytest.raises(PergradError) as refused,
    ):
        _step(many, "mnist_mlp", x, y, seed=2)
    assert refused.value.code == grpc.StatusCode.DATA_LOSS
    assert "their optimizer states differ" in refused.value.message


def test_a_replica_dying_during_the_steps_pass_is_named_and_no_replica_applies_it() -> None:
    """The step's micro-batch is in the victim's pass when the victim stops at once (no
    grace: its calls end, its port closes): the step fails naming it, and the survivor
    stays on the weights the step started from."""
    (gate, victim), (_, survivor) = (
        gated_server(replica_name=f"r{i}", max_coalesced_batch=0) for i in range(2)
    )
    targets = [f"127.0.0.1:{server.port}" for server in (victim, survivor)]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)), rng.integers(0, 3, 16)
    try:
        with GradientClient(targets[1]) as one:
            before = one.model_info("gated")
        with GradientClient(_many(targets), micro_batch=8, timeout=30) as many:
            connect_both(many, "gated", x, y)  # a micro-batch for each replica
            with ThreadPoolExecutor(1) as pool, gate.closed():
                step = pool.submit(many.step, "gated", x, y, learning_rate=0.1, max_norm=1.0)
                assert gate.entered.acquire(timeout=60), "no micro-batch reached the victim"
                victim.stop(0)
            with pytest.raises(PergradError) as refused:
                step.result(timeout=60)
        with GradientClient(targets[1]) as one:
            after = one.model_info("gated")
    finally:
        survivor.stop(0)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert targets[0] in refused.value.message
    assert (after.model_version, after.weights_id) == (before.model_version, before.weights_id)
