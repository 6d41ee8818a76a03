"""`make bench`: pergrad's engine against TensorFlow's own per-example gradient routes.

For each workload and batch size, in one run with interleaved repetitions (medians):
  mean_grad       the ordinary gradient of the mean loss (what plain training pays)
  naive_loop      B backward passes of one example each
  vectorized_map  tf.vectorized_map over a per-example tape (TensorFlow Privacy's route)
  jacobian_pfor   GradientTape.jacobian of the [B] losses, pfor
  pergrad         Engine.per_example_gradients, refilling the previous result's buffers
Every method returns full per-example tensors as numpy (mean_grad: the mean gradient).
Each method first runs alone in a fresh process, which gives its peak memory (peak RSS
above the RSS after building the model and the batch) and shows whether it survives:
TensorFlow 2.21's oneDNN BatchMatMul corrupts the heap under vectorized_map of the
transformer block. A crashed method is left out of the interleaved timing (one more
fresh process per workload and batch) and timed alone with TF_ENABLE_ONEDNN_OPTS=0,
marked "(oneDNN off)".

    python benchmarks/engine.py [--workloads W ...] [--batch-sizes 32 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    current_rss_bytes,
    interleaved_medians,
    peak_rss_bytes,
    reset_peak_rss,
    run_child,
)

from pergrad.server.engine import Engine
from pergrad.server.engine.reference import References
from pergrad.server.engine.vectorized import forward_loss, vectorized_gradients
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

WORKLOADS = ["mnist_mlp", "mnist_cnn", "wide_mlp", "transformer_block"]
METHODS = ["mean_grad", "naive_loop", "vectorized_map", "jacobian_pfor", "pergrad"]


def make_engine(workload: str, *, pergrad: bool = True) -> Engine:
    """The engine as a server builds it (XLA chosen per model) when it is measured."""
    jit_compile = "auto" if pergrad else False
    return Engine(BUILTIN_MODELS[workload](), loss=LOSS, jit_compile=jit_compile)


def make_batch(engine: Engine, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (batch, *engine.input_spec.shape)
    if engine.input_spec.dtype.kind == "i":
        x = rng.integers(0, 1000, size=shape).astype(engine.input_spec.dtype)
    else:
        x = rng.random(shape, dtype=np.float32)
    y = rng.integers(0, engine.label_spec.num_classes, size=batch).astype(np.int32)
    return x, y


def make_methods(engine: Engine, x: np.ndarray, y: np.ndarray) -> dict[str, Callable[[], object]]:
    model, loss = engine.model, engine.loss
    trainable = list(engine.passes.initial_weights())
    non_trainable = [v.value for v in model.non_trainable_variables]
    everything = list(range(len(trainable)))
    references = References(model, loss)

    @tf.function(reduce_retracing=True)
    def vectorized(trainable, non_trainable, x, y):
        return vectorized_gradients(model, loss, trainable, non_trainable, (x,), y, everything)

    @tf.function(reduce_retracing=True)
    def jacobian(trainable, non_trainable, x, y):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            losses = forward_loss(model, loss, trainable, non_trainable, (x,), y)
        return losses, tape.jacobian(losses, trainable, experimental_use_pfor=True)

    def as_numpy(computed: tuple[tf.Tensor, list[tf.Tensor]]) -> list[np.ndarray]:
        losses, grads = computed
        return [losses.numpy(), *(g.numpy() for g in grads)]

    reused = {}

    def pergrad() -> object:
        reused["out"] = engine.per_example_gradients(x, y, out=reused.get("out"))
        return reused["out"]

    return {
        "mean_grad": lambda: references.mean_gradient(x, y),
        "naive_loop": lambda: references.batch_size_one_loop(x, y),
        "vectorized_map": lambda: as_numpy(vectorized(trainable, non_trainable, x, y)),
        "jacobian_pfor": lambda: as_numpy(jacobian(trainable, non_trainable, x, y)),
        "pergrad": pergrad,
    }


def child_memory(workload: str, method: str, batch: int) -> None:
    """Peak memory of one method alone: printed as one JSON line."""
    engine = make_engine(workload, pergrad=method == "pergrad")
    x, y = make_batch(engine, batch)
    fn = make_methods(engine, x, y)[method]
    before = current_rss_bytes()
    reset_peak_rss()
    fn()
    fn()
    print(json.dumps({"peak_bytes": peak_rss_bytes() - before}))


def child_time(workload: str, batch: int, methods: list[str], repeats: int) -> None:
    """Median seconds of each method, interleaved: printed as one JSON line."""
    engine = make_engine(workload, pergrad="pergrad" in methods)
    x, y = make_batch(engine, batch)
    fns = make_methods(engine, x, y)
    print(json.dumps(interleaved_medians({m: fns[m] for m in methods}, repeats=repeats)))


def result_bytes(engine: Engine, batch: int) -> int:
    return batch * sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in engine.variables)


def measure(
    workloads: list[str], batches: list[int], methods: list[str], repeats: int
) -> list[dict]:
    script = Path(__file__)
    rows = []
    for workload in workloads:
        size = result_bytes(make_engine(workload, pergrad=False), 1)
        for batch in batches:
            args = [workload, str(batch)]
            survivors, found = [], {}
            for method in methods:
                found[method] = run_child(script, ["--child-memory", workload, method, str(batch)])
                if "crashed" not in found[method]:
                    survivors.append(method)
            medians = run_child(script, ["--child-time", *args, str(repeats), *survivors])
            for method in set(methods) - set(survivors):
                alone = run_child(
                    script,
                    ["--child-time", *args, str(repeats), method],
                    env={"TF_ENABLE_ONEDNN_OPTS": "0"},
                )
                medians |= {method: alone[method]} if method in alone else {}
            for method in methods:
                row = {
                    "workload": workload,
                    "batch": batch,
                    "method": method,
                    "result_mb": batch * size / 1e6,
                    **found[method],
                }
                if method in medians:
                    row["ms"] = 1000 * medians[method]
                rows.append(row)
            print(f"measured {workload} B={batch}", file=sys.stderr, flush=True)
    return rows


def _ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['ms'] / b['ms']:.2f}" if a and b and "ms" in a and "ms" in b else ""


def _method_row(r: dict) -> str:
    head = f"| {r['workload']} | {r['batch']} | {r['method']} |"
    if "ms" not in r:
        return f"{head} crashed ({r['crashed']}) | | |"
    throughput = f"{1000 * r['batch'] / r['ms']:,.0f}"
    if "crashed" in r:
        return f"{head} {r['ms']:.1f} (oneDNN off; crashed with it) | {throughput} | |"
    return f"{head} {r['ms']:.1f} | {throughput} | {r['peak_bytes'] / 1e6:.0f} |"


def _summary_row(by: dict, workload: str, batch: int) -> str:
    def get(method: str) -> dict | None:
        return by.get((workload, batch, method))

    ours, mean = get("pergrad"), get("mean_grad")
    memory = ""
    if ours and mean and "peak_bytes" in ours and "peak_bytes" in mean:
        bound = ours["result_mb"] + mean["peak_bytes"] / 1e6
        memory = f"{ours['peak_bytes'] / 1e6 / bound:.2f}"
    return (
        f"| {workload} | {batch} | {ours['result_mb']:.0f} | {_ratio(ours, mean)} | "
        f"{_ratio(get('vectorized_map'), ours)} | {_ratio(get('naive_loop'), ours)} | {memory} |"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | B | method | ms/batch | examples/s | peak MB |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
        *(_method_row(r) for r in rows),
        "",
        "| workload | B | result MB | pergrad / mean_grad | vectorized_map / pergrad | "
        "naive_loop / pergrad | pergrad peak / (result + mean_grad peak) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(r["workload"], r["batch"], r["method"]): r for r in rows}
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
        if (workload, batch, "pergrad") in by:
            lines.append(_summary_row(by, workload, batch))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child-memory", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--child-time", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        workload, method, batch = args.child_memory
        child_memory(workload, method, int(batch))
    elif args.child_time:
        workload, batch, repeats, *methods = args.child_time
        child_time(workload, int(batch), methods, int(repeats))
    else:
        print(table(measure(args.workloads, args.batch_sizes, args.methods, args.repeats)))


if __name__ == "__main__":
    main()
