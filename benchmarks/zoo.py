"""`make bench` (zoo): pergrad's engine against `tf.vectorized_map` on every model family
of the test zoo (tests/zoo.py: CNNs, recurrent and attention models, several inputs).

For each family, in a fresh process, interleaved (medians, ms per batch of B examples):
  vectorized_map  tf.vectorized_map over a per-example tape of every variable (TensorFlow
                  Privacy's route), in a tf.function with XLA and one without (not on
                  families with attention or stacked recurrent layers: outside XLA,
                  TensorFlow 2.21's pfor corrupts the heap or fails there); the full
                  tensors as numpy; the faster of the two is the reference
  pergrad         Engine.per_example_gradients as `pergrad serve` builds it (XLA chosen
                  per model, numpy's BLAS on one thread), full tensors; it casts and
                  checks the batch on each call, which the reference is spared
  pergrad_norms   the same engine's per-example norms (what DP clipping needs)
Both are given the same weights, read once, as a server's call is given its snapshot's
(in-process without `trainable=`, the engine reads the model's own on each call: one
compiled call, 0.24-0.72 ms here).
Families too large for full per-example gradients (`full=False`: MobileNetV3Small and
ResNet50) compare norms only: vectorized_map's norms are taken from its full tensors, in
the same graph. A vectorized_map that fails to build (pfor cannot take the gradient of
Keras's recurrent loops) is marked with its error.

    python benchmarks/zoo.py [--families F ...] [--batch-size 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from harness import interleaved_medians, run_child  # noqa: E402

from tests.zoo import FAMILIES  # noqa: E402


def _methods(name: str, batch: int) -> dict:
    """The family's callables, each computing one batch's per-example quantity as numpy."""
    import numpy as np
    import tensorflow as tf

    from pergrad.server.engine import Engine
    from pergrad.server.engine.cores import one_blas_thread
    from pergrad.server.engine.vectorized import pfor_safe, vectorized_gradients

    one_blas_thread()  # the engine as `pergrad serve` runs it
    family = FAMILIES[name]
    model, loss = family.build()
    compiled = getattr(model, "loss", None)  # the engine takes a compiled loss first
    engine = Engine(model, loss=compiled or loss, jit_compile="auto")
    x, y = family.batch(model, batch)
    inputs = engine.batch(x, y)
    trainable = list(engine.passes.initial_weights())
    non_trainable = [v.value for v in model.non_trainable_variables]
    everything = list(range(len(trainable)))

    def per_example(trainable, non_trainable, xs, y):
        losses, grads = vectorized_gradients(
            engine.model, engine.loss, trainable, non_trainable, xs, y, everything
        )
        if family.full:
            return losses, grads
        squares = [tf.reduce_sum(tf.square(g), axis=tf.range(1, tf.rank(g))) for g in grads]
        return losses, [tf.sqrt(tf.add_n(squares))]

    def timed(jit_compile: bool):
        function = tf.function(per_example, jit_compile=jit_compile)

        def run() -> list[np.ndarray]:
            losses, grads = function(trainable, non_trainable, inputs.xs, inputs.y)
            return [losses.numpy(), *(g.numpy() for g in grads)]

        return run

    methods = {"vectorized_map_xla": timed(True)}
    if pfor_safe(model):
        methods["vectorized_map"] = timed(False)
    if family.full:
        methods["pergrad"] = lambda: engine.per_example_gradients(x, y, trainable=trainable)
    methods["pergrad_norms"] = lambda: engine.per_example_gradients(
        x, y, trainable=trainable, reduction="norms"
    )
    return methods


def child(name: str, batch: int, repeats: int) -> None:
    """One family's medians in ms (and why a vectorized_map could not run): one JSON
    line."""
    methods, failed = _methods(name, batch), {}
    for method in [m for m in methods if m.startswith("vectorized_map")]:
        try:
            methods[method]()
        except Exception as err:  # pfor's own failures: the table says which
            del methods[method]
            failed[method] = type(err).__name__
    medians = interleaved_medians(methods, repeats=repeats)
    print(json.dumps({**{k: 1000 * v for k, v in medians.items()}, "failed": failed}))


def _ratio(numerator: float | None, denominator: float | None) -> str:
    """numerator / denominator, or n/a where either is missing."""
    return f"{numerator / denominator:.2f}" if numerator and denominator else "n/a"


def _cell(got: dict, method: str) -> str:
    """A method's median, or why it did not run."""
    if method in got:
        return f"{got[method]:.1f}"
    return got.get("failed", {}).get(method, "n/a")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch_size, args.repeats)
        return
    print(f"B={args.batch_size}, medians of {args.repeats} interleaved calls, ms per batch\n")
    print(
        "| family | vectorized_map, XLA off | XLA on | pergrad full | pergrad norms "
        "| full / fastest vectorized_map | norms / fastest vectorized_map |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.families:
        extra = ["--batch-size", str(args.batch_size), "--repeats", str(args.repeats)]
        got = run_child(Path(__file__), ["--child", name, *extra])
        if "crashed" in got:
            print(f"| {name} | crashed ({got['crashed']}) | | | | | |", flush=True)
            continue
        cells = [_cell(got, m) for m in ("vectorized_map", "vectorized_map_xla")]
        cells += [_cell(got, m) for m in ("pergrad", "pergrad_norms")]
        fastest = min(
            (got[m] for m in ("vectorized_map", "vectorized_map_xla") if m in got), default=None
        )
        ratios = [_ratio(got.get(m), fastest) for m in ("pergrad", "pergrad_norms")]
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
