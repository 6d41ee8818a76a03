"""`make bench` (load): many client processes against one server.

Admission (default): N client processes (16) each send a fixed number of mnist_mlp
requests with full per-example gradients (B=32, 13 MB each) to one `pergrad serve` with
small admission limits; reported: requests/s, p50/p99 latency of admitted requests,
RESOURCE_EXHAUSTED rejections, and the server's peak RSS (VmHWM) against a bound derived
from the limits.

Small requests (--small): N clients each send requests of B examples back to back for a
fixed time, `clipped_sum` or `norms` of mnist_mlp and mnist_cnn, to two servers: one
coalescing small requests (--max-coalesced-batch 128, the default where a GPU is seen),
one not (0, the default on a CPU), in alternating rounds; reported: examples/s and
p50/p99 latency, and the ratio. Then, on the server that does not coalesce, N clients of
B=8 against one client of B=128 in alternating rounds: issue 44's ratio, both sides
measured in the same run.

    python benchmarks/load.py [--clients 16] [--requests 10]
    python benchmarks/load.py --small [--clients 16] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport import cnn_batch, mlp_batch, pergrad_server

from pergrad.client import GradientClient, PergradError
from pergrad.server.config import AUTO_COALESCED_BATCH

MAX_INFLIGHT_BYTES = 64 << 20
BATCH = 32


def client(target: str, requests: int) -> None:
    """One client process: latencies of admitted requests and the count of rejections."""
    x, y = mlp_batch(BATCH)
    latencies, rejected = [], 0
    with GradientClient(target, timeout=120) as c:
        for _ in range(requests):
            start = time.perf_counter()
            try:
                c.per_example_gradients("mnist_mlp", x, y)
                latencies.append(time.perf_counter() - start)
            except PergradError as err:
                if err.code.name != "RESOURCE_EXHAUSTED":
                    raise
                rejected += 1
                time.sleep(0.05)
    print(json.dumps({"latencies": latencies, "rejected": rejected}))


SMALL_MODELS = {"mnist_mlp": mlp_batch, "mnist_cnn": cnn_batch}
SMALL_BATCHES = (8, 32, 128)
REFERENCE_BATCH = 128  # issue 44: small clients against one client of this B
SMALL_REDUCTIONS = {
    "clipped_sum": {"max_norm": 1.0, "noise_multiplier": 1.0, "seed": 1},
    "norms": {},
}
START_DELAY_S = 0.5  # from the last client's "ready" to the start of the clock


def small_client(target: str, model: str, reduction: str, batch: int) -> None:
    """One client of the small-request mode: says "ready" once connected, reads the
    clock's start and end (wall clock) from stdin, and reports the latencies of the
    requests it started between them, back to back."""
    x, y = SMALL_MODELS[model](batch)
    options = SMALL_REDUCTIONS[reduction]
    latencies = []
    with GradientClient(target, timeout=120) as c:
        c.model_info(model)  # connected before the clock starts
        print("ready", flush=True)
        start, end = map(float, sys.stdin.readline().split())
        time.sleep(max(0.0, start - time.time()))
        while time.time() < end:
            began = time.perf_counter()
            c.per_example_gradients(model, x, y, reduction=reduction, **options)
            latencies.append(time.perf_counter() - began)
    print(json.dumps({"latencies": latencies}))


def small_run(
    target: str, model: str, reduction: str, batch: int, clients: int, seconds: float
) -> tuple[float, float, float]:
    """(examples/s, p50 s, p99 s) of `clients` processes sending for `seconds`, the clock
    started once every one of them has imported and connected."""
    argv = [model, reduction, str(batch)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--small-child", target, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(clients)
    ]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    start = time.time() + START_DELAY_S
    for child in children:
        child.stdin.write(f"{start} {start + seconds}\n")
        child.stdin.flush()
    outputs = [json.loads(c.communicate(timeout=600)[0].strip().splitlines()[-1]) for c in children]
    latencies = [t for o in outputs for t in o["latencies"]]
    return (
        batch * len(latencies) / seconds,
        statistics.median(latencies),
        float(np.quantile(latencies, 0.99)),
    )


def warm_small(target: str, model: str, batches: tuple[int, ...]) -> None:
    """One call of each small-request reduction at each of `batches`: compiled before any
    clock starts."""
    with GradientClient(target) as client:
        for batch in batches:
            x, y = SMALL_MODELS[model](batch)
            for reduction, options in SMALL_REDUCTIONS.items():
                client.per_example_gradients(model, x, y, reduction=reduction, **options)


def _against_one_client(
    target: str, model: str, clients: int, seconds: float, rounds: int
) -> list[str]:
    """Rows of issue 44's ratio in one run: `clients` clients of the smallest B against
    one client of REFERENCE_BATCH, in alternating rounds, on one server."""
    rows = []
    for reduction in SMALL_REDUCTIONS:
        many, one = [], []
        for _ in range(rounds):
            many.append(small_run(target, model, reduction, SMALL_BATCHES[0], clients, seconds))
            one.append(small_run(target, model, reduction, REFERENCE_BATCH, 1, seconds))
        m, o = (statistics.median(run[0] for run in runs) for runs in (many, one))
        rows.append(f"| {model} | {reduction} | {m:.0f} | {o:.0f} | {m / o:.2f} |")
    return rows


def small(clients: int, seconds: float, rounds: int) -> None:
    """The small-request table: coalescing on and off, in alternating rounds; then
    `clients` small clients against one large (`_against_one_client`)."""
    print(
        f"| model | reduction | B | examples/s off | examples/s on | ratio | p50 ms off | "
        f"p50 ms on | p99 ms off | p99 ms on |  ({clients} clients, {seconds:.0f} s, "
        f"medians of {rounds} rounds)"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    reference = []
    for model in SMALL_MODELS:
        settings = {
            "off": ("--max-coalesced-batch", "0"),
            "on": ("--max-coalesced-batch", str(AUTO_COALESCED_BATCH)),
        }
        servers = {
            mode: pergrad_server("--model", model, "--jit-compile", "off", *flags)
            for mode, flags in settings.items()
        }
        try:
            for _, target in servers.values():
                warm_small(target, model, SMALL_BATCHES)
            for reduction in SMALL_REDUCTIONS:
                for batch in SMALL_BATCHES:
                    runs = {mode: [] for mode in servers}
                    for _ in range(rounds):
                        for mode, (_, target) in servers.items():
                            runs[mode].append(
                                small_run(target, model, reduction, batch, clients, seconds)
                            )
                    off, on = (
                        [statistics.median(r[k] for r in runs[mode]) for k in range(3)]
                        for mode in ("off", "on")
                    )
                    print(
                        f"| {model} | {reduction} | {batch} | {off[0]:.0f} | {on[0]:.0f} | "
                        f"{on[0] / off[0]:.2f} | {1000 * off[1]:.1f} | {1000 * on[1]:.1f} | "
                        f"{1000 * off[2]:.1f} | {1000 * on[2]:.1f} |",
                        flush=True,
                    )
            reference += _against_one_client(servers["off"][1], model, clients, seconds, rounds)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=60)
    _print_reference(reference, clients, rounds)


def _print_reference(rows: list[str], clients: int, rounds: int) -> None:
    print(
        f"\n| model | reduction | {clients} clients x B={SMALL_BATCHES[0]}, examples/s | "
        f"1 client x B={REFERENCE_BATCH} | ratio |  (coalescing off, medians of {rounds})"
    )
    print("| --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows))


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="the small-request mode")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--small-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        client(args.child[0], int(args.child[1]))
        return
    if args.small_child:
        target, model, reduction, batch = args.small_child
        small_client(target, model, reduction, int(batch))
        return
    if args.small:
        small(args.clients, args.seconds, args.rounds)
        return
    server, target = pergrad_server(
        "--model",
        "mnist_mlp",
        "--jit-compile",
        "off",
        "--max-inflight-bytes",
        str(MAX_INFLIGHT_BYTES),
    )
    try:
        with GradientClient(target) as warm:
            warm.per_example_gradients("mnist_mlp", *mlp_batch(BATCH))
        idle = peak_rss_bytes(server.pid)
        start = time.perf_counter()
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", target, str(args.requests)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(args.clients)
        ]
        outputs = [
            json.loads(c.communicate(timeout=600)[0].strip().splitlines()[-1]) for c in children
        ]
        elapsed = time.perf_counter() - start
        peak = peak_rss_bytes(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    latencies = sorted(t for o in outputs for t in o["latencies"])
    rejected = sum(o["rejected"] for o in outputs)
    # Bound: the RSS after warm-up, plus the admitted result bytes held twice (the engine's
    # block buffers and the gRPC send queue), plus 256 MB for TensorFlow's per-call arenas.
    bound = idle + 2 * MAX_INFLIGHT_BYTES + (256 << 20)
    print(
        "| clients | requests | admitted/s | p50 ms | p99 ms | rejected | server peak RSS MB "
        "| bound MB |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.clients} | {args.clients * args.requests} | {len(latencies) / elapsed:.1f} | "
        f"{1000 * statistics.median(latencies):.0f} | "
        f"{1000 * float(np.quantile(latencies, 0.99)):.0f} | {rejected} | "
        f"{peak / 1e6:.0f} | {bound / 1e6:.0f} |"
    )
    if peak > bound:
        raise SystemExit(
            f"server peak RSS {peak / 1e6:.0f} MB above the bound {bound / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
