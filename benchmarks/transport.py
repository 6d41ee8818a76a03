"""`make bench`: what the wire costs. One run, medians, every server in a process of its own.

raw ceiling      a minimal gRPC server streams the same bytes in 1 MiB (and 4 MiB)
                 `bytes` messages; the client copies them into a preallocated array
pure transport   pergrad's server and client with the computation replaced by a
                 precomputed result (mnist_mlp per-example gradients of 25 and 250 MB)
float32/bfloat16 pure transport with each wire dtype, examples/s
end to end       the real remote call vs the in-process engine + pure transport of the
                 same bytes (mnist_mlp, mnist_cnn, B=256)
replicas         mnist_cnn B=256 through 1 vs 2 server processes (micro-batches of 128)
client memory    peak RSS of a client process receiving the 250 MB result

  python benchmarks/transport.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    current_rss_bytes,
    interleaved_medians,
    peak_rss_bytes,
    reset_peak_rss,
    run_child,
)

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer

MLP_ROW_BYTES = 101_770 * 4 + 4  # one example's gradients and loss
SIZES = {"25MB": 64, "250MB": 614}  # mnist_mlp examples per batch
CHUNKS = [1 << 20, 4 << 20]
_RAW = "/bench.Raw/Stream"


def _ready(process: subprocess.Popen) -> str:
    for line in process.stderr:
        if match := re.search(r"ready on (\S+:\d+)", line):
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return match.group(1)
    raise RuntimeError(f"server exited with {process.wait()}")


def spawn(*args: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, *args], stderr=subprocess.PIPE, text=True)
    return process, _ready(process)


def pergrad_server(*flags: str) -> tuple[subprocess.Popen, str]:
    server = LocalServer(*flags)
    return server.process, server.target


# -- raw ceiling -------------------------------------------------------------------------


def serve_raw() -> None:
    """A gRPC server that streams `total` bytes in `chunk`-byte messages, no protobuf."""

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        total, chunk = map(int, request.decode().split())
        payload = b"\x01" * chunk
        for offset in range(0, total, chunk):
            yield payload[: min(chunk, total - offset)]

    serve_bare("bench.Raw", "Stream", stream)


def serve_bare(service: str, method: str, stream: Callable, *, as_stream: bool = False) -> None:
    """A bare gRPC server (no protobuf, no interceptors) with one unary-stream method; it
    prints its ready line (`spawn` reads it) and serves until killed. `as_stream` serves
    the method as pergrad's guard serves one taking one request, to time the wait for it:
    request-streaming, its one request read and then the client's end."""
    method_handler = grpc.unary_stream_rpc_method_handler(stream)
    if as_stream:

        def one_request(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator:
            request = next(requests)
            if next(requests, None) is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one request")
            return stream(request, context)

        method_handler = grpc.stream_stream_rpc_method_handler(one_request)
    serve_handler(grpc.method_handlers_generic_handler(service, {method: method_handler}))


def serve_handler(handler: grpc.GenericRpcHandler, *, threads: int = 4) -> None:
    """A bare sync gRPC server of `handler` on a free loopback port: prints its ready line
    (`announce`) and serves until killed."""
    server = grpc.server(
        futures.ThreadPoolExecutor(threads),
        handlers=[handler],
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    announce(port)
    server.wait_for_termination()


def announce(port: int) -> None:
    """The line `spawn` waits for: the server listens on 127.0.0.1:`port`."""
    print(f"ready on 127.0.0.1:{port}", file=sys.stderr, flush=True)


def raw_fetch(channel: grpc.Channel, total: int, chunk: int) -> Callable[[], object]:
    call = channel.unary_stream(_RAW)
    out = np.empty(total, np.uint8)

    def fetch() -> object:
        offset = 0
        for message in call(f"{total} {chunk}".encode(), timeout=300):
            out[offset : offset + len(message)] = np.frombuffer(message, np.uint8)
            offset += len(message)
        return out

    return fetch


# -- pure transport: pergrad's service with a precomputed result --------------------------


def serve_replay(batch: int) -> None:
    """pergrad's real server, its mnist_mlp engine replaced by replaying one result."""
    from pergrad.server.config import Config
    from pergrad.server.engine import SliceResult
    from pergrad.server.main import start
    from pergrad.server.models.registry import ModelRegistry, load_model

    served = load_model("mnist_mlp", model_dir=None, jit_compile=False)
    x, y = mlp_batch(batch)
    result = served.engine.per_example_gradients(x, y)
    grads = list(result.gradients.values())
    engine = served.engine

    def replay(batch, *, variables=None, trainable=None, buffer_sets=1, block_bytes=16 << 20):
        block = max(1, block_bytes // (MLP_ROW_BYTES - 4))
        for lo in range(0, batch.size, block):
            hi = min(lo + block, batch.size)
            yield SliceResult(lo, hi, result.losses[lo:hi], [g[lo:hi] for g in grads])

    engine.passes.blocks = replay
    running = start(Config(host="127.0.0.1", port=0, metrics_port=0), ModelRegistry([served]))
    announce(running.port)
    running.server.wait_for_termination()


def refilling(client: GradientClient, model: str, x, y, **kwargs) -> Callable[[], object]:
    """A remote call that refills the previous result's arrays, as a trainer's loop would."""
    kept: dict[str, object] = {}

    def call() -> object:
        kept["out"] = client.per_example_gradients(model, x, y, out=kept.get("out"), **kwargs)
        return kept["out"]

    return call


def mlp_batch(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((batch, 784), dtype=np.float32), rng.integers(0, 10, batch).astype(np.int32)


def cnn_batch(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    return x, rng.integers(0, 10, batch).astype(np.int32)


def engine_seconds(model: str, batch: int, repeats: int) -> float:
    """In-process engine time for a full result, buffers refilled (a child's median)."""
    return run_child(Path(__file__), ["--child-engine", model, str(batch), str(repeats)])["s"]


def child_engine(model: str, batch: int, repeats: int) -> None:
    from pergrad.server.models.registry import load_model

    engine = load_model(model, model_dir=None).engine
    x, y = (mlp_batch if model == "mnist_mlp" else cnn_batch)(batch)
    out = engine.per_example_gradients(x, y)
    fn = lambda: engine.per_example_gradients(x, y, out=out)  # noqa: E731
    print(json.dumps({"s": interleaved_medians({"e": fn}, repeats=repeats)["e"]}))


def child_client_memory(target: str, batch: int) -> None:
    with GradientClient(target, timeout=300) as client:
        x, y = mlp_batch(batch)
        client.model_info("mnist_mlp")
        before = current_rss_bytes()
        reset_peak_rss()
        result = client.per_example_gradients("mnist_mlp", x, y)
        size = sum(g.nbytes for g in result.gradients.values()) + result.losses.nbytes
        print(json.dumps({"peak": peak_rss_bytes() - before, "result": size}))


# -- the run -----------------------------------------------------------------------------


def measure(repeats: int) -> list[str]:
    rows = [
        "| what | size | ms | MB/s | examples/s | note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]

    def row(what: str, size: str, seconds: float, nbytes: int, examples: int = 0, note: str = ""):
        rate = f"{examples / seconds:,.0f}" if examples else ""
        rows.append(
            f"| {what} | {size} | {1000 * seconds:.1f} | {nbytes / seconds / 1e6:,.0f} | "
            f"{rate} | {note} |"
        )

    raw, raw_target = spawn(__file__, "--serve-raw")
    replay = {name: spawn(__file__, "--serve-replay", str(b)) for name, b in SIZES.items()}
    try:
        with grpc.insecure_channel(
            raw_target, options=[("grpc.max_receive_message_length", -1)]
        ) as channel:
            ceiling = {}
            for name, batch in SIZES.items():
                total = batch * MLP_ROW_BYTES
                fns = {c: raw_fetch(channel, total, c) for c in CHUNKS}
                medians = interleaved_medians(fns, repeats=repeats)
                for chunk, seconds in medians.items():
                    row("raw gRPC ceiling", name, seconds, total, note=f"{chunk >> 20} MiB chunks")
                ceiling[name] = min(medians.values())
        for name, batch in SIZES.items():
            x, y = mlp_batch(batch)
            with GradientClient(replay[name][1], timeout=300) as client:
                fns = {
                    dtype: refilling(client, "mnist_mlp", x, y, wire_dtype=dtype)
                    for dtype in ("float32", "bfloat16")
                }
                medians = interleaved_medians(fns, repeats=repeats)
            total = batch * MLP_ROW_BYTES
            row(
                "pergrad pure transport",
                name,
                medians["float32"],
                total,
                batch,
                f"{ceiling[name] / medians['float32']:.2f} x ceiling",
            )
            row(
                "pergrad pure transport, bfloat16",
                name,
                medians["bfloat16"],
                total // 2,
                batch,
                f"{medians['float32'] / medians['bfloat16']:.2f} x float32 examples/s",
            )
        memory = run_child(Path(__file__), ["--child-client-memory", replay["250MB"][1], "614"])
        rows.append(
            f"| client peak RSS, 250MB result | 250MB | | | | "
            f"{memory['peak'] / memory['result']:.2f} x result size |"
        )
    finally:
        for process in [raw, *(p for p, _ in replay.values())]:
            process.kill()
    end_to_end(rows, row, repeats)
    return rows


def end_to_end(rows: list[str], row: Callable, repeats: int) -> None:
    replay_256, replay_target = spawn(__file__, "--serve-replay", "256")
    servers = [pergrad_server("--model", "mnist_mlp", "--model", "mnist_cnn") for _ in range(2)]
    try:
        x, y = mlp_batch(256)
        with GradientClient(replay_target, timeout=300) as client:
            transport = interleaved_medians(
                {"t": refilling(client, "mnist_mlp", x, y)}, repeats=repeats
            )["t"]
        for model, batch_fn in (("mnist_mlp", mlp_batch), ("mnist_cnn", cnn_batch)):
            x, y = batch_fn(256)
            engine = engine_seconds(model, 256, repeats)
            with GradientClient(servers[0][1], timeout=300) as client:
                remote = interleaved_medians(
                    {"r": refilling(client, model, x, y)},
                    repeats=repeats,
                )["r"]
            size = 101_770 if model == "mnist_mlp" else 26_010
            nbytes = 256 * (size * 4 + 4)
            cnn_transport = transport * nbytes / (256 * MLP_ROW_BYTES)
            bound = engine + (transport if model == "mnist_mlp" else cnn_transport)
            row(
                f"end to end {model}",
                "B=256",
                remote,
                nbytes,
                256,
                f"{remote / bound:.2f} x (engine {1000 * engine:.1f} ms + transport)",
            )
        x, y = cnn_batch(256)
        targets = {
            "1 replica": servers[0][1],
            "2 replicas": "ipv4:" + ",".join(t for _, t in servers),
        }
        times = {}
        for label, target in targets.items():
            with GradientClient(target, timeout=300, micro_batch=128) as client:
                for _ in range(2):
                    client.per_example_gradients("mnist_cnn", x, y)
                times[label] = interleaved_medians(
                    {"r": lambda c=client: c.per_example_gradients("mnist_cnn", x, y)},
                    repeats=repeats,
                )["r"]
        for label, seconds in times.items():
            row(
                f"mnist_cnn, {label}",
                "B=256",
                seconds,
                256 * (26_010 * 4 + 4),
                256,
                f"{times['1 replica'] / seconds:.2f} x one replica",
            )
    finally:
        for process in [replay_256, *(p for p, _ in servers)]:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-replay", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-engine", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--child-client-memory", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_raw:
        serve_raw()
    elif args.serve_replay:
        serve_replay(args.serve_replay)
    elif args.child_engine:
        model, batch, repeats = args.child_engine
        child_engine(model, int(batch), int(repeats))
    elif args.child_client_memory:
        child_client_memory(args.child_client_memory[0], int(args.child_client_memory[1]))
    else:
        start = time.perf_counter()
        print("\n".join(measure(args.repeats)))
        print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
