"""`make bench-peers`: pergrad's Engine against torch.func and Opacus (hooks and ghost
clipping) on the same weights and data.

For each built-in model this saves its Keras weights (by variable path), a fixed random
batch and Keras's per-example losses to an .npz; `peers_torch.py`, in its own
virtualenv (.venv-peers: torch 2.13.0 CPU, opacus), rebuilds the same model in PyTorch
from it and checks its losses match before timing anything.

Quantities, each a whole batch's per-example computation (per-example losses included):
  full         full per-example gradients [B, *shape] of every variable
  norms        per-example gradient norms (over all variables)
  clipped_sum  sum_b min(1, C / ||g_b||) g_b with C = 1 (noise 0)
Tools: pergrad (Engine(model, loss=LOSS, jit_compile="auto").per_example_gradients,
reduction "none" / "norms" / "clipped_sum"; numpy's BLAS on one thread, as served);
torch.func (vmap(grad_and_value) of one example's loss, then norms and clipping from the
full tensors); Opacus hooks
(GradSampleModule's grad_sample, clipping by DPOptimizer.clip_and_accumulate); Opacus
ghost clipping (GradSampleModuleFastGradientClipping: norms from the first backward,
the clipped sum from DPLossFastGradientClipping's second one; no full tensors).

Every (tool, workload, quantity) runs in a fresh process per round, with 2 threads
(torch.set_num_threads(2); TensorFlow's intra- and inter-op pools set to 2 before it does
any work): warm-up calls, then the median of --calls timed calls (at least 3; no more
once the timed calls pass 5 s). Rounds alternate over all of them (the tools' order
rotating each round); the figure is the median of the rounds' medians. Every process's
last result is kept, and the per-example norms (and clipped sums) of all tools are
checked against pergrad's. Other work on the machine skews single rounds badly (torch's
OpenMP threads suffer most): the per-round table and the load average show it.

    python benchmarks/peers.py [--workloads W ...] [--batch-size 256] [--rounds 3]
        [--calls 5] [--warmup 2] [--peers-python .venv-peers/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = ["mnist_mlp", "mnist_cnn", "wide_mlp", "transformer_block"]
QUANTITIES = ["full", "norms", "clipped_sum"]
TOOLS = ["pergrad", "torch_func", "opacus_hooks", "opacus_ghost"]
LABELS = {
    "pergrad": "pergrad",
    "torch_func": "torch.func",
    "opacus_hooks": "Opacus hooks",
    "opacus_ghost": "Opacus ghost",
}
MAX_NORM = 1.0
NORM_TOLERANCE = 1e-4  # relative, per example
SUM_TOLERANCE = 1e-4  # relative to the clipped sum's norm
THREADS = 2
BUDGET_S = 5.0  # timed calls stop past this, once there are MIN_CALLS
MIN_CALLS = 3


def enough(times: list[float]) -> bool:
    return len(times) >= MIN_CALLS and sum(times) > BUDGET_S


def applies(tool: str, quantity: str) -> bool:
    """Ghost clipping never forms full per-example gradients."""
    return not (tool == "opacus_ghost" and quantity == "full")


# --- Children (main virtualenv): the shared data, and pergrad's timing ------------------


def _tensorflow():
    """TensorFlow with THREADS intra- and inter-op threads, set before it does any work."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    return tf


def export(workload: str, batch: int, path: str) -> None:
    """Save the model's trainable weights (by variable path), a fixed batch and Keras's
    per-example losses on it."""
    _tensorflow()
    import keras

    from pergrad.server.models.builtin import BUILTIN_MODELS

    model = BUILTIN_MODELS[workload]()
    rng = np.random.default_rng(20261201)
    shape = (batch, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):
        x = rng.integers(0, 1000, size=shape).astype(np.int32)
    else:
        x = rng.random(shape, dtype=np.float32)
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    logits = model(x, training=False)
    losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    weights = {f"w:{v.path}": np.asarray(v.numpy()) for v in model.trainable_variables}
    np.savez(path, x=x, y=y, losses=np.asarray(losses, np.float32), **weights)
    print(json.dumps({"variables": len(weights), "examples": batch}))


def child_pergrad(workload: str, quantity: str, data: str, out: str, warmup: int, calls: int):
    """Time one pergrad quantity on the saved weights and batch; print one JSON line."""
    _tensorflow()
    from pergrad.server.engine import Engine
    from pergrad.server.engine.cores import one_blas_thread
    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    one_blas_thread()  # the engine as `pergrad serve` runs it

    saved = np.load(data)
    model = BUILTIN_MODELS[workload]()
    for v in model.trainable_variables:
        v.assign(saved[f"w:{v.path}"])
    x, y = saved["x"], saved["y"]
    engine = Engine(model, loss=LOSS, jit_compile="auto")
    options = {"full": {}, "norms": {"reduction": "norms"}}
    options["clipped_sum"] = {"reduction": "clipped_sum", "max_norm": MAX_NORM}

    def run():
        return engine.per_example_gradients(x, y, **options[quantity])

    for _ in range(warmup):
        result = run()
    times = []
    while len(times) < calls and not enough(times):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)

    kept = {"losses": result.losses}
    if quantity == "full":
        grads = [result.gradients[v.name] for v in engine.variables]
        squares = sum(np.square(g.reshape(len(g), -1), dtype=np.float64).sum(1) for g in grads)
        kept["norms"] = np.sqrt(squares).astype(np.float32)
    else:
        kept["norms"] = result.norms
    if quantity == "clipped_sum":
        kept.update({f"sum:{name}": value for name, value in result.clipped_sum.items()})
    np.savez(out, **kept)
    print(
        json.dumps(
            {
                "median_s": statistics.median(times),
                "times_s": times,
                "engine": engine.summary,
            }
        )
    )


# --- The driver -------------------------------------------------------------------------


def run_json(command: list[str], timeout_s: float = 900) -> dict:
    """Run a child that prints one JSON line last; failures come back as {"error": ...}."""
    try:
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {run.returncode}: {tail[:300]}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure_one(
    tool: str, workload: str, quantity: str, data: Path, out: Path, args: argparse.Namespace
) -> dict:
    timing = ["--warmup", str(args.warmup), "--calls", str(args.calls)]
    if tool == "pergrad":
        command = [sys.executable, str(Path(__file__)), "--child", workload, quantity]
        command += [str(data), str(out), *timing]
    else:
        command = [args.peers_python, str(HERE / "peers_torch.py"), tool, workload, quantity]
        command += [str(data), str(out), *timing, "--threads", str(THREADS)]
    return run_json(command)


def relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Largest per-element |a - b| / |b|."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def clipped_sum(saved) -> dict[str, np.ndarray]:
    """A saved result's clipped sum, {Keras variable path: array}."""
    return {k[len("sum:") :]: saved[k] for k in saved.files if k.startswith("sum:")}


def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([arrays[k].astype(np.float64).reshape(-1) for k in sorted(arrays)])


def checks(
    tools: list[str], workloads: list[str], quantities: list[str], tmp: Path
) -> tuple[list[list[str]], bool]:
    """Each tool's norms (and clipped sum) of the quantities measured against pergrad's,
    per workload; rows for a table and whether all agree."""
    rows, ok = [], True
    for workload in workloads:
        data = np.load(tmp / f"{workload}.npz")
        # pergrad's norms, or those its other quantities saved where norms did not run
        saved = [tmp / f"pergrad-{workload}-{q}.npz" for q in ("norms", *quantities)]
        reference = next((path for path in saved if path.exists()), None)
        if reference is None:
            rows.append([workload, "pergrad", "no pergrad norms to compare", "", "", "FAIL"])
            ok = False
            continue
        ref = np.load(reference)
        ref_sum_path = tmp / f"pergrad-{workload}-clipped_sum.npz"
        ref_sum = clipped_sum(np.load(ref_sum_path)) if ref_sum_path.exists() else None
        for tool in tools:
            for quantity in quantities:
                path = tmp / f"{tool}-{workload}-{quantity}.npz"
                if not applies(tool, quantity):
                    continue
                if not path.exists():
                    rows.append([workload, f"{LABELS[tool]} {quantity}", "missing", "", "", "FAIL"])
                    ok = False
                    continue
                got = np.load(path)
                loss_gap = float(np.max(np.abs(got["losses"] - data["losses"])))
                norm_gap = relative_gap(got["norms"], ref["norms"])
                sum_gap = ""
                good = norm_gap <= NORM_TOLERANCE and loss_gap <= 1e-4
                if quantity == "clipped_sum" and ref_sum is not None:
                    mine = clipped_sum(got)
                    gap = float(np.inf)
                    if set(mine) == set(ref_sum):
                        gap = float(
                            np.linalg.norm(flat(mine) - flat(ref_sum))
                            / max(np.linalg.norm(flat(ref_sum)), 1e-12)
                        )
                    sum_gap = f"{gap:.1e}"
                    good = good and gap <= SUM_TOLERANCE
                ok = ok and good
                rows.append(
                    [
                        workload,
                        f"{LABELS[tool]} {quantity}",
                        f"{loss_gap:.1e}",
                        f"{norm_gap:.1e}",
                        sum_gap,
                        "ok" if good else "FAIL",
                    ]
                )
    return rows, ok


def table(header: list[str], rows: list[list[str]], right: int = 0) -> str:
    align = ["---"] * (len(header) - right) + ["---:"] * right
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


Key = tuple[str, str, str]  # (tool, workload, quantity)


def measure(args: argparse.Namespace, tmp: Path) -> tuple[dict[Key, list[float]], dict, dict]:
    """Every round runs every (workload, quantity, tool) once, each in a fresh process,
    the tools' order rotating by one each round. Returns each key's per-round medians,
    the errors of failed runs, and notes (the engine's XLA choice, the peers' versions)."""
    started = time.perf_counter()
    medians: dict[Key, list[float]] = {}
    errors: dict[Key, str] = {}
    notes: dict[str, str] = {}
    for round_ in range(args.rounds):
        turn = round_ % len(args.tools)
        order = args.tools[turn:] + args.tools[:turn]
        for workload in args.workloads:
            data = tmp / f"{workload}.npz"
            for quantity in args.quantities:
                for tool in (t for t in order if applies(t, quantity)):
                    key = (tool, workload, quantity)
                    out = tmp / f"{tool}-{workload}-{quantity}.npz"
                    found = measure_one(tool, workload, quantity, data, out, args)
                    if "error" in found:
                        errors[key] = found["error"]
                        print(f"round {round_ + 1}: {key}: {found['error']}", file=sys.stderr)
                        continue
                    medians.setdefault(key, []).append(found["median_s"])
                    if tool == "pergrad":
                        notes[workload] = found["engine"]
                    else:
                        notes["peers"] = f"torch {found['torch']}, opacus {found['opacus']}"
        elapsed = time.perf_counter() - started
        print(f"round {round_ + 1} of {args.rounds} done at {elapsed:.0f} s", file=sys.stderr)
    return medians, errors, notes


def summary(
    args: argparse.Namespace, medians: dict[Key, list[float]], errors: dict[Key, str]
) -> tuple[list[list[str]], list[list[str]], list[bool]]:
    """Rows of the main table (medians of the rounds' medians), rows of the per-round
    table, and for each (workload, quantity) whether pergrad was no slower than the
    fastest other tool."""
    rows, round_rows, verdicts = [], [], []
    for workload in args.workloads:
        for quantity in args.quantities:
            cells, per_round, others = [], [], {}
            for tool in TOOLS:
                key = (tool, workload, quantity)
                if tool not in args.tools or not applies(tool, quantity):
                    cells.append("n/a")
                    per_round.append("n/a")
                    continue
                per_round.append(" / ".join(f"{1000 * t:.1f}" for t in medians.get(key, [])))
                if len(medians.get(key, [])) == args.rounds:
                    ms = 1000 * statistics.median(medians[key])
                    cells.append(f"{ms:.1f}")
                    if tool != "pergrad":
                        others[tool] = ms
                else:
                    cells.append(f"failed ({errors.get(key, 'incomplete')})")
            fastest = min(others, key=others.get) if others else None
            ratio = ""
            mine = medians.get(("pergrad", workload, quantity), [])
            if fastest and len(mine) == args.rounds:
                ms = 1000 * statistics.median(mine)
                ratio = f"{ms / others[fastest]:.2f}"
                verdicts.append(ms <= others[fastest])
            rows.append([workload, quantity, *cells, LABELS.get(fastest, ""), ratio])
            round_rows.append([workload, quantity, *per_round])
    return rows, round_rows, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--quantities", nargs="+", default=QUANTITIES, choices=QUANTITIES)
    parser.add_argument("--tools", nargs="+", default=TOOLS, choices=TOOLS)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--peers-python",
        default=str(ROOT / ".venv-peers" / "bin" / "python"),
        help="the interpreter of the PyTorch + Opacus virtualenv",
    )
    parser.add_argument("--child", nargs=4, metavar=("WORKLOAD", "QUANTITY", "DATA", "OUT"))
    parser.add_argument("--export", nargs=2, metavar=("WORKLOAD", "PATH"))
    args = parser.parse_args()

    if args.export:
        export(args.export[0], args.batch_size, args.export[1])
        return
    if args.child:
        child_pergrad(*args.child, warmup=args.warmup, calls=args.calls)
        return
    if "pergrad" not in args.tools:
        args.tools.insert(0, "pergrad")  # the reference for every check and ratio

    started, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pergrad-peers-") as tmpdir:
        tmp = Path(tmpdir)
        for workload in args.workloads:
            path = tmp / f"{workload}.npz"
            command = [sys.executable, str(Path(__file__)), "--batch-size", str(args.batch_size)]
            made = run_json([*command, "--export", workload, str(path)])
            if "error" in made:
                raise SystemExit(f"export of {workload} failed: {made['error']}")
        medians, errors, notes = measure(args, tmp)
        check_rows, agree = checks(args.tools, args.workloads, args.quantities, tmp)
    rows, round_rows, verdicts = summary(args, medians, errors)

    print(
        f"\nB={args.batch_size}, {THREADS} threads per process; ms per batch: median over "
        f"{args.rounds} rounds (a fresh process each) of the median of {args.calls} calls "
        f"after {args.warmup} warm-up calls. {notes.get('peers', '')}. Load average "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n"
    )
    labels = [f"{LABELS[t]} ms" for t in TOOLS]
    header = ["workload", "quantity", *labels, "fastest other", "pergrad / fastest other"]
    print(table(header, rows, right=6))
    print(
        f"\npergrad no slower than the fastest other on {sum(verdicts)} of {len(verdicts)} "
        "(workload, quantity) pairs.\n\nEach round's median (ms):\n"
    )
    print(table(["workload", "quantity", *labels], round_rows, right=4))
    print("\nEngine choices (jit_compile='auto', the last pergrad process of each workload):")
    for workload in args.workloads:
        print(f"- {workload}: {notes.get(workload, '(no pergrad run)')}")
    print(
        f"\nAgreement (losses: max |diff| against Keras's; norms: max relative per-example "
        f"diff against pergrad's norms, tolerance {NORM_TOLERANCE:g}; clipped sum: "
        f"||diff|| / ||pergrad's||, tolerance {SUM_TOLERANCE:g}):\n"
    )
    header = ["workload", "method", "loss diff", "norm rel diff", "clipped sum rel diff", "check"]
    print(table(header, check_rows, right=3))
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    if not agree or errors:
        raise SystemExit("some runs failed or disagree with pergrad: see above")


if __name__ == "__main__":
    main()
