"""`make bench` (DP step): one DP-SGD step through the service against an ordinary step.

What a DP user pays per step, B=256, for mnist_mlp, mnist_cnn and transformer_block:

  TF step     the ordinary non-private training step of the same model in TensorFlow:
              one compiled function (forward, mean loss, gradient, SGD update), in
              this process
  server step `client.step` against a `pergrad serve` process of its own (SGD):
              the server clips, sums, noises (max_norm 1, noise multiplier 1, seeded)
              and applies the update; only the batch and the step's report travel
  get/set     the loop before ApplyStep: `clipped_sum` of the batch at the current
              version, the update w -= lr * sum / B in numpy, `set_weights` pinned to
              that version (its two calls also timed alone)
  engine      the step's per-example work alone: the engine's seeded clipped sum of
              the batch in this process (what no wire or server change can remove)

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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport import pergrad_server

from pergrad.client import GradientClient
from pergrad.server.engine.cores import one_blas_thread

BATCH = 256
LR = 0.1
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
            max_norm=1.0,
            noise_multiplier=1.0,
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
            max_norm=1.0,
            noise_multiplier=1.0,
            seed=self.pin,
            model_version=self.pin,
        ).model_version


def _at_current(client: GradientClient, model: str, fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, its pin moved to the model's current version first (the two loops take turns
    on one model, each moving it), outside the time taken."""
    if hasattr(fn, "pin"):
        fn.pin = client.model_info(model).model_version
    return fn


def engine_clipped_sum(model_name: str, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    """The step's per-example work alone: the engine's seeded clipped sum, in process."""
    from pergrad.server.engine import Engine
    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    engine = Engine(BUILTIN_MODELS[model_name](), loss=LOSS)
    return lambda: engine.per_example_gradients(
        x, y, reduction="clipped_sum", max_norm=1.0, noise_multiplier=1.0, seed=1
    )


def _timed(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(model: str, steps: int) -> dict[str, float]:
    server, target = pergrad_server("--model", model)
    try:
        with GradientClient(target, timeout=300) as client:
            x, y = _batch(client.model_info(model))
            methods = {
                "tf": tf_step(model, x, y),
                "engine": engine_clipped_sum(model, x, y),
                "server": ServerStep(client, model, x, y),
                "dp": DpStep(client, model, x, y),
            }
            for fn in methods.values():  # warm: tracing, allocation
                for _ in range(2):
                    _at_current(client, model, fn)()
            dp = methods["dp"]
            dp.times = {k: [] for k in dp.times}
            times: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(steps):
                for name, fn in methods.items():
                    times[name].append(_timed(_at_current(client, model, fn)))
    finally:
        server.terminate()
        server.wait(timeout=60)
    medians = {name: statistics.median(t) for name, t in times.items()}
    medians |= {name: statistics.median(t) for name, t in dp.times.items()}
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    one_blas_thread()  # the in-process engine as `pergrad serve` runs it
    print(
        f"| model (B={BATCH}) | TF step ms | server step ms | ratio | get/set step ms | ratio "
        "| its clipped_sum ms | its set_weights ms | engine clipped_sum ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models:
        m = measure(model, args.steps)
        print(
            f"| {model} | {1000 * m['tf']:.1f} | {1000 * m['server']:.1f} | "
            f"{m['server'] / m['tf']:.2f} | {1000 * m['dp']:.1f} | {m['dp'] / m['tf']:.2f} | "
            f"{1000 * m['clipped_sum']:.1f} | {1000 * m['set_weights']:.1f} | "
            f"{1000 * m['engine']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
