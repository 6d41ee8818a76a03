"""`make bench` (DP step): one DP-SGD step through the service against an ordinary step.

What a DP user pays per step, B=256, for mnist_mlp, mnist_cnn and transformer_block:

  TF step     the ordinary non-private training step of the same model in TensorFlow:
              one compiled function (forward, mean loss, gradient, SGD update), in
              this process
  server step `client.step` against a `pergrad serve` process of its own (SGD):
              the server clips, sums, noises (max_norm 1, noise multiplier 1, seeded)
              and applies the update; only the batch and the step's report travel
  get/set     the loop before ApplyStep, on a second server: `clipped_sum` of the batch
              at the current version, the update w -= lr * sum / B in numpy,
              `set_weights` pinned to that version (its two calls also timed alone)
  engine      the step's per-example work alone: the engine's seeded clipped sum of
              the batch in this process (what no wire or server change can remove)
  vmap        the naive local DP-SGD step (TensorFlow Privacy's route): per-example
              gradients by tf.vectorized_map, clipped, summed, Gaussian noise, SGD, in
              one compiled function with XLA and without (outside XLA only where pfor
              computes the model), the faster of the two
  echo        a bare gRPC echo (no protobuf, no Python beyond the handler) of the batch's
              bytes, answered with a step report's: the wire a remote step cannot avoid

The four take turns in every round; figures are medians.

    python benchmarks/dp_step.py [--steps 15] [--models ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import echo_call
from transport import spawn

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer
from pergrad.server.engine.cores import one_blas_thread

BATCH = 256
LR = 0.1
MAX_NORM = 1.0
NOISE_MULTIPLIER = 1.0
MODELS = ("mnist_mlp", "mnist_cnn", "transformer_block")


def _batch(info) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (BATCH, *info.input.shape[1:])
    if info.input.dtype.kind == "i":
        x = rng.integers(0, 100, shape).astype(info.input.dtype)
    else:
        x = rng.random(shape, dtype=np.float32)
    return x, rng.integers(0, info.num_classes, BATCH).astype(np.int32)


def tf_step(model_name: str, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    """The ordinary training step of the built-in model, compiled, on its own variables."""
    import keras
    import tensorflow as tf

    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    model = BUILTIN_MODELS[model_name]()
    optimizer = keras.optimizers.SGD(LR)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=False)
    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    tx, ty = tf.constant(x), tf.constant(y)
    return lambda: step(tx, ty)


class DpStep:
    """One DP-SGD step through the service, and the time of its two calls."""

    def __init__(self, client: GradientClient, model: str, x: np.ndarray, y: np.ndarray):
        self._client, self._model, self._x, self._y = client, model, x, y
        self.pin, self._weights = client.get_weights(model)
        self.times: dict[str, list[float]] = {"clipped_sum": [], "set_weights": []}

    def __call__(self) -> None:
        began = time.perf_counter()
        result = self._client.per_example_gradients(
            self._model,
            self._x,
            self._y,
            reduction="clipped_sum",
            max_norm=MAX_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            seed=self.pin,
            model_version=self.pin,
        )
        computed = time.perf_counter()
        for name, total in result.clipped_sum.items():
            self._weights[name] -= np.float32(LR / BATCH) * total
        sent = time.perf_counter()
        self.pin = self._client.set_weights(self._model, self._weights, expected_version=self.pin)
        self.times["clipped_sum"].append(computed - began)
        self.times["set_weights"].append(time.perf_counter() - sent)


class ServerStep:
    """One DP-SGD step taken by the server, pinned to the version the last one made."""

    def __init__(self, client: GradientClient, model: str, x: np.ndarray, y: np.ndarray):
        self._client, self._model, self._x, self._y = client, model, x, y
        self.pin = client.model_info(model).model_version

    def __call__(self) -> None:
        self.pin = self._client.step(
            self._model,
            self._x,
            self._y,
            learning_rate=LR,
            expected_batch_size=BATCH,
            max_norm=MAX_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            seed=self.pin,
            model_version=self.pin,
        ).model_version


def engine_clipped_sum(model_name: str, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    """The step's per-example work alone: the engine's seeded clipped sum, in process."""
    from pergrad.server.engine import Engine
    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    engine = Engine(BUILTIN_MODELS[model_name](), loss=LOSS)
    return lambda: engine.per_example_gradients(
        x, y, reduction="clipped_sum", max_norm=MAX_NORM, noise_multiplier=NOISE_MULTIPLIER, seed=1
    )


def vmap_step(model_name: str, x: np.ndarray, y: np.ndarray, jit: bool) -> Callable[[], None]:
    """The naive local DP-SGD step on the built-in model's own variables, compiled."""
    import keras
    import tensorflow as tf

    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    model = BUILTIN_MODELS[model_name]()
    variables = model.trainable_variables
    keras.utils.set_random_seed(0)

    def one_example(example: tuple[tf.Tensor, tf.Tensor]) -> list[tf.Tensor]:
        xi, yi = example
        with tf.GradientTape() as tape:
            loss = LOSS(yi[None], model(xi[None], training=True))
        return tape.gradient(loss, variables)

    @tf.function(jit_compile=jit)
    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        grads = tf.vectorized_map(one_example, (x, y))
        squares = [tf.reduce_sum(tf.reshape(g * g, [BATCH, -1]), axis=1) for g in grads]
        scale = tf.minimum(1.0, MAX_NORM / (tf.sqrt(tf.add_n(squares)) + 1e-12))
        for variable, g in zip(variables, grads, strict=True):
            noise = tf.random.normal(variable.shape, stddev=NOISE_MULTIPLIER * MAX_NORM)
            variable.assign_sub(LR / BATCH * (tf.tensordot(scale, g, axes=1) + noise))

    tx, ty = tf.constant(x), tf.constant(y)
    return lambda: step(tx, ty)


def vmap_steps(model_name: str, x: np.ndarray, y: np.ndarray) -> dict[str, Callable[[], None]]:
    """The naive step with XLA, and without it where pfor computes the model."""
    from pergrad.server.engine.vectorized import pfor_safe
    from pergrad.server.models.builtin import BUILTIN_MODELS

    steps = {"vmap_xla": vmap_step(model_name, x, y, jit=True)}
    if pfor_safe(BUILTIN_MODELS[model_name]()):
        steps["vmap"] = vmap_step(model_name, x, y, jit=False)
    return steps


def wire_echo(channel: grpc.Channel, x: np.ndarray, y: np.ndarray) -> Callable[[], object]:
    """The batch's bytes through a bare gRPC echo, answered by a step report's bytes
    (a loss and a norm per example)."""
    return echo_call(channel, x.nbytes + y.nbytes, [b"\x00" * (8 * BATCH + 64)])


def _timed(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(model: str, steps: int, echo: grpc.Channel) -> dict[str, float]:
    """Medians of every route's step; the two remote loops each on a server of their own,
    as a trainer uses one or the other (a step right after a `set_weights` also builds
    the optimizer's fresh state: +10 ms on mnist_mlp)."""
    with (
        LocalServer("--model", model) as server,
        LocalServer("--model", model) as loop_server,
        GradientClient(server.target, timeout=300) as client,
        GradientClient(loop_server.target, timeout=300) as loop_client,
    ):
        x, y = _batch(client.model_info(model))
        methods = {
            "tf": tf_step(model, x, y),
            "engine": engine_clipped_sum(model, x, y),
            "server": ServerStep(client, model, x, y),
            "dp": DpStep(loop_client, model, x, y),
            "echo": wire_echo(echo, x, y),
            **vmap_steps(model, x, y),
        }
        for fn in methods.values():  # warm: tracing, allocation
            for _ in range(2):
                fn()
        dp = methods["dp"]
        dp.times = {k: [] for k in dp.times}
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(steps):
            for name, fn in methods.items():
                times[name].append(_timed(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}
    medians |= {name: statistics.median(t) for name, t in dp.times.items()}
    medians["vmap"] = min(medians.get("vmap", np.inf), medians.pop("vmap_xla"))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    one_blas_thread()  # the in-process engine as `pergrad serve` runs it
    echo, echo_target = spawn(str(Path(__file__).with_name("latency.py")), "--echo-server")
    print(
        f"| model (B={BATCH}) | TF step ms | server step ms | / TF | get/set step ms | / TF "
        "| its clipped_sum ms | its set_weights ms | engine clipped_sum ms | echo ms "
        "| server - engine - echo ms | vmap DP step ms | server / vmap |"
    )
    print("| --- |" + " ---: |" * 12)
    try:
        channel = grpc.insecure_channel(echo_target)
        for model in args.models:
            print(_row(model, measure(model, args.steps, channel)), flush=True)
    finally:
        echo.kill()


def _row(model: str, m: dict[str, float]) -> str:
    ms = {name: 1000 * seconds for name, seconds in m.items()}
    rest = ms["server"] - ms["engine"] - ms["echo"]
    return (
        f"| {model} | {ms['tf']:.1f} | {ms['server']:.1f} | {m['server'] / m['tf']:.2f} | "
        f"{ms['dp']:.1f} | {m['dp'] / m['tf']:.2f} | {ms['clipped_sum']:.1f} | "
        f"{ms['set_weights']:.1f} | {ms['engine']:.1f} | {ms['echo']:.2f} | {rest:.1f} | "
        f"{ms['vmap']:.1f} | {m['server'] / m['vmap']:.2f} |"
    )


if __name__ == "__main__":
    main()
