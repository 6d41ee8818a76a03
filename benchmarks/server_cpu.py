"""`make bench` (server_cpu): what a small call costs the server's CPU, by phase (issue 44).

A `pergrad serve` of mnist_mlp (`--jit-compile off`, as shipped) answers small calls
(ListModels, the entrance alone; B=8 `norms` and seeded `clipped_sum`), from one caller
in a loop and then from 16 callers at once (threads of this process on one channel: one
connection, so one caller to pergrad's guard, which computes a caller's calls on half its
workers; `small_floor.py` has 16 connections); a bare grpcio echo server (`latency.py`'s)
answers requests of the same bytes with responses of the same bytes, the same ways, and a
second one serves its method as pergrad's guard must (request-streaming: its one request
read, then the client's end, so that a client that never sends it can be timed; a unary
handler's thread waits for its request inside grpcio, out of reach). Every request is
serialized once, before the clock starts, so the client's own work is the same for every
server. For each cell:

- the in-process engine's CPU per call for the same batch and options (a child process,
  the engine as `pergrad serve` builds it), and what the server spends beyond it and the
  echo served as a stream: its path's own cost;
- the server process's CPU per call (user + system, from /proc/PID/task/*/stat around the
  calls), split by thread: Python's (the handlers, the guard, parsing, numpy), TensorFlow's
  own pools (`tf_*`: the pass's kernels) and gRPC's core (`event_engine`, its pollers);
- the Python threads' CPU split by phase, from py-spy's samples of every thread that is
  running (`py-spy record --nonblocking`, idle threads left out): each sample's innermost
  frame of a known module names its phase (`PHASES`): gRPC's poll is the server thread
  driving gRPC's C core (receiving and sending), gRPC (Python) its Python server around a
  handler, thread handoffs the pools' workers waking and sleeping.

    python benchmarks/server_cpu.py [--calls 1500] [--callers 1 16] [--modes ...]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import run_child
from latency import echo_call
from transport import spawn

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.chunks import identity
from pergrad.wire.rpc import method_path

MODEL = "mnist_mlp"
BATCH = 8
# The modes' gradients calls' options; `list_models` (the service's cheapest call: the
# entrance alone, its guard, interceptors, stall timer and places) has none.
MODES: dict[str, dict | None] = {
    "list_models": None,
    "norms": {"reduction": "norms"},
    "clipped_sum": {
        "reduction": "clipped_sum",
        "max_norm": 1.0,
        "noise_multiplier": 1.0,
        "seed": 7,
    },
}
# Each sample's phase: the first of these found in its frames, innermost first.
PHASES = (
    ("noise", ("random_streams.py", "box_muller.py", "/ln.py", "sincos.py")),
    ("reduction", ("/reductions/", "sinks.py", "in_pass.py")),
    ("pass", ("compiled.py", "passes.py", "ruled.py", "engine/grads.py")),
    ("encode", ("wire/chunks.py", "result_header", "result_arrays", "iter_raw_chunks",
                "wire_bytes")),
    ("parse", ("status.py", "declared.py", "wire/fields.py", "unparsed.py", "decode_tensor")),
    ("checks", ("engine/batch.py", "casting.py", "messages.py", "catalogue.py", "terms.py",
                "results.py", "gradients.py", "weights.py", "registry.py")),
    ("admission", ("/admission/",)),
    ("guard", ("transport/guard.py", "stalls.py", "handlers.py", "open_services.py", "auth.py")),
    ("metrics", ("interceptors.py", "metrics.py", "tracking.py", "prometheus_client")),
    ("gRPC's poll", ("_serve (",)),  # the server thread's completion queue: its C core
    ("gRPC (Python)", ("grpc/",)),
    ("thread handoffs", ("concurrent/futures/thread.py",)),
)  # fmt: skip
OTHER = "other"
# Which threads a thread's name (its comm) says it is.
THREAD_KINDS = (("tensorflow", "tf_"), ("python", "python"), ("python", "pergrad"))
GRPC_CORE = "grpc core"


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """Each thread of `pid`: its name and the CPU seconds it has used (user + system)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (comm, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _kind(comm: str) -> str:
    return next((kind for kind, prefix in THREAD_KINDS if comm.startswith(prefix)), GRPC_CORE)


def cpu_by_kind(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds used between two `thread_cpu` readings, by kind of thread."""
    used: dict[str, float] = collections.Counter()
    for tid, (comm, seconds) in after.items():
        used[_kind(comm)] += seconds - before.get(tid, (comm, 0.0))[1]
    return dict(used)


# TensorFlow's and Keras's frames are the work of whichever frame of pergrad's called them
# (the pass, noise, a reduction's products); a stack of theirs alone is the pass's.
TENSORFLOW = ("/tensorflow/", "/keras/")


def phase_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        if any(library in frame for library in TENSORFLOW):
            continue
        for phase, patterns in PHASES:
            if any(pattern in frame for pattern in patterns):
                return phase
    return "pass" if any(lib in f for f in frames for lib in TENSORFLOW) else OTHER


def sampled_phases(raw: str) -> collections.Counter[str]:
    """Samples by phase, from py-spy's raw output ("frame;frame;... count" a line)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[phase_of(stack.split(";"))] += int(count)
    return counts


@contextmanager
def profiled(pid: int, samples: collections.Counter[str]) -> Iterator[None]:
    """py-spy sampling every running thread of `pid` while the block runs; its samples by
    phase added to `samples`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "raw.txt"
        spy = subprocess.Popen(
            [_py_spy(), "record", "--pid", str(pid), "--rate", "500", "--format", "raw",
             "--full-filenames", "--nonblocking", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # attached
        try:
            yield
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        samples.update(sampled_phases(out.read_text()))


def _py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is needed: pip install py-spy")
    return found


def calls_from(callers: int, call: Callable[[], object], count: int) -> float:
    """Wall seconds for `count` calls made by `callers` threads at once."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=callers) as pool:
        for _ in pool.map(lambda _: call(), range(count)):
            pass
    return time.perf_counter() - began


def measure(pid: int, call: Callable[[], object], count: int, callers: int, profile: bool) -> dict:
    """Calls per second, CPU seconds per call by kind of thread, and (with `profile`) the
    Python threads' samples by phase."""
    calls_from(callers, call, 50)  # warm: compiled functions, buffers, connections
    samples: collections.Counter[str] = collections.Counter()
    with profiled(pid, samples) if profile else contextlib.nullcontext():
        before = thread_cpu(pid)
        wall = calls_from(callers, call, count)
        after = thread_cpu(pid)
    per_call = {kind: seconds / count for kind, seconds in cpu_by_kind(before, after).items()}
    return {"rate": count / wall, "cpu": per_call, "samples": samples}


def raw_call(channel: grpc.Channel, request: bytes, mode: str) -> Callable[[], list[bytes]]:
    """One call of the mode with the serialized request, its responses as bytes."""
    if MODES[mode] is None:
        listing = channel.unary_unary(
            method_path("ListModels"), request_serializer=identity, response_deserializer=identity
        )
        return lambda: [listing(request, timeout=300)]
    call = channel.unary_stream(
        method_path("ComputePerExampleGradients"),
        request_serializer=identity,
        response_deserializer=identity,
    )
    return lambda: list(call(request, timeout=300))


def _batch(example_shape: tuple[int, ...], classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, *example_shape)).astype(np.float32)
    return x, rng.integers(0, classes, BATCH).astype(np.int32)


def _request(client: GradientClient, options: dict | None) -> bytes:
    if options is None:
        return pb.ListModelsRequest().SerializeToString()
    info = client.model_info(MODEL)
    batch = _batch(tuple(info.input.shape[1:]), info.num_classes)
    request = client._call(MODEL, **options).request(info, *batch)
    return request.inline().SerializeToString()


def engine_child(mode: str, count: int) -> None:
    """The in-process engine's CPU a call for the mode's request (as `pergrad serve` builds
    it: XLA off, numpy's BLAS on one thread): one JSON line."""
    from pergrad.server.engine import Engine
    from pergrad.server.engine.cores import one_blas_thread
    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    one_blas_thread()
    model = BUILTIN_MODELS[MODEL]()
    engine = Engine(model, loss=LOSS, jit_compile=False)
    x, y = _batch(tuple(model.input_shape[1:]), model.output_shape[-1])
    options = MODES[mode] or {}
    for _ in range(50):
        engine.per_example_gradients(x, y, **options)
    began = time.process_time()
    for _ in range(count):
        engine.per_example_gradients(x, y, **options)
    print(json.dumps({"cpu": (time.process_time() - began) / count}))


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3f}"


def report(rows: list[tuple[str, int, float, dict, dict, dict]]) -> str:
    kinds = ("python", "tensorflow", GRPC_CORE)
    lines = [
        "| mode | callers | pergrad calls/s | echo calls/s | echo as stream calls/s | pergrad "
        "CPU ms/call | of which Python / TF / gRPC core | echo CPU ms/call | echo as stream "
        "CPU ms/call | pergrad / echo | pergrad / echo as stream | engine in-process CPU "
        "ms/call | pergrad - engine - echo as stream |",
        "| --- | ---: |" + " ---: |" * 4 + " --- |" + " ---: |" * 6,
    ]
    for mode, callers, engine, ours, echo, streamed in rows:
        total = sum(ours["cpu"].values())
        echo_total, streamed_total = sum(echo["cpu"].values()), sum(streamed["cpu"].values())
        split = " / ".join(_ms(ours["cpu"].get(k, 0.0)) for k in kinds)
        lines.append(
            f"| {mode} | {callers} | {ours['rate']:.0f} | {echo['rate']:.0f} | "
            f"{streamed['rate']:.0f} | {_ms(total)} | {split} | {_ms(echo_total)} | "
            f"{_ms(streamed_total)} | {total / echo_total:.1f}x | "
            f"{total / streamed_total:.1f}x | {_ms(engine)} | "
            f"{_ms(total - engine - streamed_total)} |"
        )
    phases = [p for p, _ in PHASES] + [OTHER]
    lines += ["", "Python threads' CPU per call by phase, ms (py-spy samples' shares):", ""]
    lines += ["| mode | callers | " + " | ".join(phases) + " |"]
    lines += ["| --- | ---: |" + " ---: |" * len(phases)]
    for mode, callers, _, ours, *_ in rows:
        samples, python = ours["samples"], ours["cpu"].get("python", 0.0)
        total = sum(samples.values()) or 1
        cells = " | ".join(_ms(python * samples[p] / total) for p in phases)
        lines.append(f"| {mode} | {callers} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--engine-child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_child(args.engine_child, args.calls)
        return
    engine = {
        mode: run_child(Path(__file__), ["--engine-child", mode, "--calls", str(args.calls)])["cpu"]
        if MODES[mode] is not None
        else 0.0
        for mode in args.modes
    }
    latency = str(Path(__file__).resolve().with_name("latency.py"))
    echo_server, echo_target = spawn(latency, "--echo-server")
    stream_server, stream_target = spawn(latency, "--echo-server", "--as-stream")
    rows = []
    try:
        echo_channel = grpc.insecure_channel(echo_target)
        stream_channel = grpc.insecure_channel(stream_target)
        with (
            LocalServer("--model", MODEL, "--jit-compile", "off") as server,
            GradientClient(server.target, timeout=300) as client,
        ):
            channel = grpc.insecure_channel(server.target)
            for mode in args.modes:
                request = _request(client, MODES[mode])
                call = raw_call(channel, request, mode)
                echo = echo_call(echo_channel, len(request), call())
                as_stream = echo_call(stream_channel, len(request), call())
                for callers in args.callers:
                    ours = measure(server.process.pid, call, args.calls, callers, profile=True)
                    theirs = measure(echo_server.pid, echo, args.calls, callers, profile=False)
                    streamed = measure(stream_server.pid, as_stream, args.calls, callers, False)
                    rows.append((mode, callers, engine[mode], ours, theirs, streamed))
                    print(f"{mode} x{callers}: {ours['rate']:.0f} calls/s", file=sys.stderr)
    finally:
        echo_server.kill()
        stream_server.kill()
    print(report(rows))


if __name__ == "__main__":
    main()
