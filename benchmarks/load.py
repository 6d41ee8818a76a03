"""`make bench` (load): many client processes against one server with admission limits.

N client processes (default 16) each send a fixed number of mnist_mlp requests with full
per-example gradients (B=32, 13 MB each) to one `pergrad serve` with small admission
limits; reported: requests/s, p50/p99 latency of admitted requests, RESOURCE_EXHAUSTED
rejections, and the server's peak RSS (VmHWM) against a bound derived from the limits.

    python benchmarks/load.py [--clients 16] [--requests 10]
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
from transport import mlp_batch, pergrad_server

from pergrad.client import GradientClient, PergradError

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
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        client(args.child[0], int(args.child[1]))
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
