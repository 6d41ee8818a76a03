"""`make bench`: pergrad's engine against TensorFlow's own per-example gradient routes.

For each workload and batch size, in one run with interleaved repetitions (medians):
  mean_grad       the ordinary gradient of the mean loss (what plain training pays)
  naive_loop      B backward passes of one example each
  vectorized_map  tf.vectorized_map over a per-example tape (TensorFlow Privacy's route)
  jacobian_pfor   GradientTape.jacobian of the [B] losses, pfor
  pergrad         Engine.per_example_gradients, refilling the previous result's buffers
Every method returns full per-example tensors as numpy (mean_grad: the mean gradient).
Peak memory: each method alone in a fresh process at the largest batch, peak RSS above
the RSS after building the model and the batch.

    python benchmarks/engine.py [--workloads ...] [--batch-sizes 32 256] [--repeats 5]
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
from harness import current_rss_bytes, interleaved_medians, peak_rss_bytes, run_child

from pergrad.server.engine import Engine
from pergrad.server.engine.reference import References
from pergrad.server.engine.vectorized import forward_loss, vectorized_gradients
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

WORKLOADS = ["mnist_mlp", "mnist_cnn", "wide_mlp", "transformer_block"]
METHODS = ["mean_grad", "naive_loop", "vectorized_map", "jacobian_pfor", "pergrad"]


def make_engine(workload: str) -> Engine:
    return Engine(BUILTIN_MODELS[workload](), loss=LOSS)


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
    trainable = list(engine.initial_weights())
    non_trainable = [v.value for v in model.non_trainable_variables]
    everything = list(range(len(trainable)))
    references = References(model, loss)

    @tf.function(reduce_retracing=True)
    def vectorized(trainable, non_trainable, x, y):
        return vectorized_gradients(model, loss, trainable, non_trainable, x, y, everything)

    @tf.function(reduce_retracing=True)
    def jacobian(trainable, non_trainable, x, y):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            losses = forward_loss(model, loss, trainable, non_trainable, x, y)
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


def child(workload: str, method: str, batch: int) -> None:
    """Peak memory of one method alone: printed as one JSON line."""
    engine = make_engine(workload)
    x, y = make_batch(engine, batch)
    fn = make_methods(engine, x, y)[method]
    before = current_rss_bytes()
    fn()
    fn()
    print(json.dumps({"peak_bytes": peak_rss_bytes() - before}))


def result_bytes(engine: Engine, batch: int) -> int:
    return batch * sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in engine.variables)


def measure(
    workloads: list[str], batches: list[int], methods: list[str], repeats: int, memory: bool
) -> list[dict]:
    rows = []
    for workload in workloads:
        engine = make_engine(workload)
        for batch in batches:
            x, y = make_batch(engine, batch)
            fns = make_methods(engine, x, y)
            medians = interleaved_medians({m: fns[m] for m in methods}, repeats=repeats)
            for method in methods:
                row = {
                    "workload": workload,
                    "batch": batch,
                    "method": method,
                    "ms": 1000 * medians[method],
                    "result_mb": result_bytes(engine, batch) / 1e6,
                }
                if memory and batch == max(batches):
                    peak = run_child(Path(__file__), [workload, method, str(batch)])["peak_bytes"]
                    row["peak_mb"] = peak / 1e6
                rows.append(row)
            print(f"measured {workload} B={batch}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | B | method | ms/batch | examples/s | peak MB |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        peak = f"{r['peak_mb']:.0f}" if "peak_mb" in r else ""
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['ms']:.1f} | "
            f"{1000 * r['batch'] / r['ms']:,.0f} | {peak} |"
        )
    lines += [
        "",
        "| workload | B | result MB | pergrad / mean_grad | vectorized_map / pergrad "
        "| naive_loop / pergrad | pergrad peak / (result + mean_grad peak) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(r["workload"], r["batch"], r["method"]): r for r in rows}
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
        get = lambda m: by.get((workload, batch, m))  # noqa: E731
        ours, mean, vmap, loop = (
            get("pergrad"),
            get("mean_grad"),
            get("vectorized_map"),
            get("naive_loop"),
        )
        if not ours:
            continue
        ratio = lambda a, b: f"{a['ms'] / b['ms']:.2f}" if a and b else ""  # noqa: E731
        memory = ""
        if mean and "peak_mb" in ours and "peak_mb" in mean:
            memory = f"{ours['peak_mb'] / (ours['result_mb'] + mean['peak_mb']):.2f}"
        lines.append(
            f"| {workload} | {batch} | {ours['result_mb']:.0f} | {ratio(ours, mean)} | "
            f"{ratio(vmap, ours)} | {ratio(loop, ours)} | {memory} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    rows = measure(args.workloads, args.batch_sizes, args.methods, args.repeats, not args.no_memory)
    print(table(rows))


if __name__ == "__main__":
    main()
