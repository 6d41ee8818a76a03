"""`make bench`: server-side reductions against the ordinary mean gradient, and against
the same reduction done by a client from full per-example tensors.

For each workload at one batch size, in one run (medians):
  mean_grad        the ordinary gradient of the mean loss (the floor)
  full             Engine.per_example_gradients, full tensors into reused buffers
  norms, clipped_sum (max_norm 1), moments, dot (K=8), project (dim 512)
                   Engine.per_example_gradients(reduction=...)
  client <mode>    a real server streams full tensors to the client, which then reduces
                   them in numpy: median fetch time + median numpy time
Peak memory: each engine method alone in a fresh process (peak RSS above the RSS after
building the model and the batch).

    python benchmarks/reductions.py [--workloads ...] [--batch-size 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_batch, make_engine
from harness import (
    current_rss_bytes,
    interleaved_medians,
    peak_rss_bytes,
    reset_peak_rss,
    run_child,
)

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer
from pergrad.server.engine import Engine
from pergrad.server.engine.cores import one_blas_thread
from pergrad.server.engine.reference import References

WORKLOADS = ["mnist_cnn", "wide_mlp", "transformer_block"]
MODES = ["norms", "clipped_sum", "moments", "dot", "project"]
METHODS = ["mean_grad", "full", *MODES]


def options_for(mode: str, engine: Engine) -> dict:
    if mode == "clipped_sum":
        return {"max_norm": 1.0}
    if mode == "dot":
        rng = np.random.default_rng(0)
        return {
            "reference": {
                v.name: rng.standard_normal((8, *v.shape)).astype(np.float32)
                for v in engine.variables
            }
        }
    if mode == "project":
        return {"dim": 512, "seed": 0}
    return {}


def make_methods(engine: Engine, x: np.ndarray, y: np.ndarray) -> dict[str, Callable[[], object]]:
    references = References(engine.model, engine.loss)
    reused = {}

    def full() -> object:
        reused["out"] = engine.per_example_gradients(x, y, out=reused.get("out"))
        return reused["out"]

    methods: dict[str, Callable[[], object]] = {
        "mean_grad": lambda: references.mean_gradient(x, y),
        "full": full,
    }
    for mode in MODES:
        options = options_for(mode, engine)
        methods[mode] = lambda m=mode, o=options: engine.per_example_gradients(
            x, y, reduction=m, **o
        )
    return methods


def numpy_reduction(mode: str, grads: dict[str, np.ndarray], options: dict) -> object:
    """The reduction a client would do itself from full per-example tensors."""
    flat = {k: g.reshape(len(g), -1) for k, g in grads.items()}
    if mode in ("norms", "clipped_sum"):
        norms = np.sqrt(sum(np.einsum("bp,bp->b", f, f) for f in flat.values()))
        if mode == "norms":
            return norms
        scale = np.minimum(1.0, options["max_norm"] / norms).astype(np.float32)
        return {k: scale @ f for k, f in flat.items()}
    if mode == "moments":
        return {k: (f.sum(0), np.square(f).sum(0)) for k, f in flat.items()}
    if mode == "dot":
        return sum(f @ options["reference"][k].reshape(8, -1).T for k, f in flat.items())
    rng = np.random.default_rng(0)
    return sum(
        f @ rng.choice([-1.0, 1.0], (f.shape[1], 512)).astype(np.float32) for f in flat.values()
    )


def client_side(workload: str, batch: int, repeats: int) -> dict[str, float]:
    """Median fetch time of full tensors plus median numpy time per mode, seconds."""
    engine = make_engine(workload, pergrad=False)
    x, y = make_batch(engine, batch)
    with (
        LocalServer("--model", workload) as server,
        GradientClient(server.target, timeout=600) as client,
    ):
        fetch = functools.partial(client.per_example_gradients, workload, x, y)
        fetched = fetch()
        fetch_s = interleaved_medians({"fetch": fetch}, repeats=max(1, repeats // 2))["fetch"]
    options = {m: options_for(m, engine) for m in MODES}
    reduce = {
        m: functools.partial(numpy_reduction, m, fetched.gradients, options[m]) for m in MODES
    }
    return {m: fetch_s + s for m, s in interleaved_medians(reduce, repeats=repeats).items()}


def child_memory(workload: str, method: str, batch: int) -> None:
    engine = make_engine(workload)
    x, y = make_batch(engine, batch)
    fn = make_methods(engine, x, y)[method]
    before = current_rss_bytes()
    reset_peak_rss()
    fn()
    fn()
    print(json.dumps({"peak_bytes": peak_rss_bytes() - before}))


def child_time(workload: str, batch: int, repeats: int) -> None:
    engine = make_engine(workload)
    x, y = make_batch(engine, batch)
    medians = interleaved_medians(make_methods(engine, x, y), repeats=repeats)
    print(json.dumps(medians))


def table(workload: str, batch: int, ms: dict, peaks: dict, client_ms: dict) -> list[str]:
    lines = []
    for method in METHODS:
        ratio = ms[method] / ms["mean_grad"]
        client = f"{client_ms[method]:.0f}" if method in client_ms else ""
        lines.append(
            f"| {workload} | {batch} | {method} | {ms[method]:.1f} | {ratio:.2f} | "
            f"{peaks[method] / 1e6:.0f} | {peaks[method] / peaks['mean_grad']:.2f} | "
            f"{client} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child-memory", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--child-time", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    one_blas_thread()  # the engine as `pergrad serve` runs it
    if args.child_memory:
        child_memory(args.child_memory[0], args.child_memory[1], int(args.child_memory[2]))
        return
    if args.child_time:
        child_time(args.child_time[0], int(args.child_time[1]), int(args.child_time[2]))
        return
    script, batch = Path(__file__), str(args.batch_size)
    lines = [
        "| workload | B | method | ms/batch | / mean_grad | peak MB | peak / mean_grad's "
        "| client from full tensors, ms |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload in args.workloads:
        peaks = {
            m: run_child(script, ["--child-memory", workload, m, batch])["peak_bytes"]
            for m in METHODS
        }
        seconds = run_child(script, ["--child-time", workload, batch, str(args.repeats)])
        client = client_side(workload, args.batch_size, args.repeats)
        ms = {m: 1000 * s for m, s in seconds.items()}
        lines += table(
            workload, args.batch_size, ms, peaks, {m: 1000 * s for m, s in client.items()}
        )
        print(f"measured {workload}", file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
