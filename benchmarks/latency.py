"""`make bench`: where one gradients call's time goes, beside what it is compared with.

For mnist_mlp and mnist_cnn, B in {1, 8, 64, 256} and each mode (full gradients, norms,
clipped sums without noise, with unseeded noise and with seeded noise), medians of
interleaved rounds in one run:

  tf mean grad   TensorFlow's own gradient of the mean loss as a training step computes it:
                 a tf.function of (x, y) over the model's variables, in this process
  engine         the in-process `Engine.compute` of the same request
  remote         `GradientClient.per_example_gradients` against `pergrad serve` (a process
                 of its own, --jit-compile off, every other flag its default)
  echo           a bare gRPC server answering a request of the same bytes with a stream of
                 the same bytes in as many messages: what the wire alone costs here

and the remote call split into phases, each timed in this process with the functions the
client and the server run:

  encode         client: check the options, cast the batch, build and serialize the request
  prepare        server: parse the request, decode and check the batch, price the result
  compute        server: the pass, the reduction and its noise, as the server runs them (a
                 small request through its model's coalescer where the server's defaults
                 share passes: on a GPU, not on a CPU)
  noise          of which the noise: compute with noise minus compute without
  respond        server: admission, the result checked, its header, chunking, encoding
  decode         client: the responses read, checked and assembled into arrays
  grpc           the rest of the remote call: gRPC on both sides, the loopback, the server's
                 guard, interceptors and metrics (remote minus every phase above)

  python benchmarks/latency.py [--models mnist_mlp] [--batch-sizes 8 64] [--repeats 25]
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians
from transport import serve_bare, spawn

from pergrad.client import GradientClient
from pergrad.client._call import Call
from pergrad.client._receive import read_results
from pergrad.client.local import LocalServer
from pergrad.server.admission.inflight import Admission
from pergrad.server.coalescer import Coalescer
from pergrad.server.config import Config
from pergrad.server.devices import with_coalescing_resolved
from pergrad.server.engine.cores import one_blas_thread
from pergrad.server.engine.engine import Engine
from pergrad.server.engine.group import Job
from pergrad.server.gradients import Charge, Settings, Work, prepare, responses
from pergrad.server.main import build_registry
from pergrad.server.models.registry import ServedModel
from pergrad.server.sharing import granule_for
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.chunks import serialize

MODES: dict[str, dict[str, Any]] = {
    "none": {"reduction": "none"},
    "norms": {"reduction": "norms"},
    "clipped_sum": {"reduction": "clipped_sum", "max_norm": 1.0},
    "clipped_sum+noise": {"reduction": "clipped_sum", "max_norm": 1.0, "noise_multiplier": 1.0},
    "clipped_sum+seed": {
        "reduction": "clipped_sum",
        "max_norm": 1.0,
        "noise_multiplier": 1.0,
        "seed": 7,
    },
}
_ECHO = "/bench.Echo/Call"
PHASES = ["encode", "prepare", "compute", "respond", "decode"]


# -- the echo: the same bytes through bare gRPC -------------------------------------------


def serve_echo(*, as_stream: bool = False) -> None:
    """A unary-stream gRPC method answering `(total, messages)` and any payload with
    `messages` messages of `total` bytes in all; no protobuf either way (`as_stream`:
    served as request-streaming, as pergrad's guard serves a method taking one request)."""

    def call(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        total, messages = struct.unpack("<QQ", request[:16])
        size = -(-total // messages)
        payload = b"\x01" * size
        for offset in range(0, total, size):
            yield payload[: min(size, total - offset)]

    serve_bare("bench.Echo", "Call", call, as_stream=as_stream)


def echo_call(channel: grpc.Channel, request_bytes: int, response: list[bytes]) -> Callable:
    """One echo of a request of `request_bytes` answered by `response`'s byte count and
    message count, the answer read into one buffer as the client would."""
    call = channel.unary_stream(_ECHO)
    total = sum(len(m) for m in response)
    request = struct.pack("<QQ", total, len(response)) + b"\x00" * max(0, request_bytes - 16)
    out = np.empty(total, np.uint8)

    def echo() -> object:
        offset = 0
        for message in call(request, timeout=300):
            out[offset : offset + len(message)] = np.frombuffer(message, np.uint8)
            offset += len(message)
        return out

    return echo


# -- one call's phases, in this process ----------------------------------------------------


class Phases:
    """The client's and the server's steps of one request, each callable on its own."""

    def __init__(self, served: ServedModel, info: Any, x: np.ndarray, y: np.ndarray, mode: str):
        config = Config()
        self.served, self.engine = served, served.engine
        self.admission = Admission(
            max_examples=config.max_inflight_examples, max_bytes=config.max_inflight_bytes
        )
        self.settings = Settings.of(with_coalescing_resolved(config))
        bound = self.settings.max_coalesced_batch
        self.coalescer = (
            Coalescer(
                self.engine,
                window_s=config.batch_window_ms / 1000,
                granule=granule_for(self.engine, bound),
            )
            if bound
            else None
        )
        self.info, self.x, self.y, self.options = info, x, y, MODES[mode]
        self.request = self.encode()
        self.work = self.prepare()
        self.messages = [serialize(m) for m in self.respond()]

    def close(self) -> None:
        if self.coalescer is not None:
            self.coalescer.close()

    def encode(self) -> bytes:
        call = Call.of(self.served.name, **self.options)
        return call.request(self.info, self.x, self.y).inline().SerializeToString()

    def prepare(self) -> Work:
        request = pb.GradientsRequest.FromString(self.request)
        return prepare(self.served, Whole(request), self.settings)

    def compute(self) -> object:
        work = self.work
        asked = work.asked
        if self._shared():
            sink = self.engine.passes.sink(
                work.batch.size,
                reduction=asked.reduction.name,
                variables=asked.variables,
                **asked.options,
            )
            return self.coalescer.compute(Job(work.batch, sink), work.snapshot)
        if asked.reduction.name == "none":
            return list(self.engine.passes.blocks(work.batch, trainable=work.snapshot.trainable))
        return self.engine.compute(
            work.batch,
            reduction=asked.reduction.name,
            trainable=work.snapshot.trainable,
            **asked.options,
        )

    def respond(self) -> list[Any]:
        """Compute and the response messages, as the servicer makes them."""
        coalescer = self.coalescer if self._shared() else None
        return list(
            responses(self.work, 0, self.settings, Charge(self.admission, lambda: False), coalescer)
        )

    def _shared(self) -> bool:
        """Whether the server, with its defaults, puts this request through a shared pass."""
        return self.coalescer is not None and self.coalescer.takes(self.work.batch.size)

    def decode(self) -> object:
        expected = Call.of(self.served.name, **self.options).expected(self.info, len(self.y))
        return list(read_results(iter(self.messages), lambda _: expected))


# -- the run -------------------------------------------------------------------------------


def mean_gradient(engine: Engine) -> Callable[[np.ndarray, np.ndarray], list[np.ndarray]]:
    """The gradient of the mean loss, compiled, as numpy: what a plain training step pays."""
    model, loss = engine.model, engine.loss

    @tf.function
    def gradient(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            mean = tf.reduce_mean(loss(y, model(x, training=False)))
        return tape.gradient(mean, model.trainable_variables)

    return lambda x, y: [g.numpy() for g in gradient(x, y)]


def batch_of(engine: Engine, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What a trainer has: float64 pixels and int64 labels, numpy's defaults."""
    rng = np.random.default_rng(size)
    shape = tuple(d or 1 for d in engine.input_spec.shape)
    return rng.random((size, *shape)), rng.integers(0, 10, size)


def measure_cell(
    served: ServedModel,
    client: GradientClient,
    echo_channel: grpc.Channel,
    batch: int,
    mode: str,
    repeats: int,
) -> dict[str, float]:
    engine = served.engine
    x, y = batch_of(engine, batch)
    info = client.model_info(served.name)
    phases = Phases(served, info, x, y, mode)
    mean_grad = mean_gradient(engine)
    cast = engine.batch(x, y)
    options = MODES[mode]
    try:
        methods = {
            "tf mean grad": lambda: mean_grad(cast.xs[0], cast.y),
            "engine": lambda: engine.compute(cast, **options),
            "remote": lambda: client.per_example_gradients(served.name, x, y, **options),
            "echo": echo_call(echo_channel, len(phases.request), phases.messages),
            "encode": phases.encode,
            "prepare": phases.prepare,
            "respond": phases.respond,
            "decode": phases.decode,
            "compute": phases.compute,
        }
        times = interleaved_medians(methods, repeats=repeats)
    finally:
        phases.close()
    times["respond"] = max(0.0, times["respond"] - times["compute"])
    times["grpc"] = times["remote"] - sum(times[p] for p in PHASES)
    times["request KB"] = len(phases.request) / 1024
    times["response KB"] = sum(len(m) for m in phases.messages) / 1024
    times["messages"] = len(phases.messages)
    return times


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.2f}"


def tables(rows: list[tuple[str, int, str, dict[str, float]]]) -> str:
    by = {(m, b, mode): t for m, b, mode, t in rows}
    out = [
        "| model | B | mode | tf mean grad ms | engine ms | remote ms | echo ms | "
        "remote - engine | bound: max(3 x echo, 1.5 ms) | engine / tf mean grad |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model, batch, mode, t in rows:
        gap = t["remote"] - t["engine"]
        bound = max(3 * t["echo"], 0.0015)
        out.append(
            f"| {model} | {batch} | {mode} | {ms(t['tf mean grad'])} | {ms(t['engine'])} | "
            f"{ms(t['remote'])} | {ms(t['echo'])} | {ms(gap)} "
            f"{'(met)' if gap <= bound else '(not met)'} | {ms(bound)} | "
            f"{t['engine'] / t['tf mean grad']:.2f} |"
        )
    out += [
        "",
        "| model | B | mode | request KB | response KB, messages | encode | prepare | "
        "compute | of which noise | respond | decode | grpc | remote ms |",
        "| --- | ---: | --- |" + " ---: |" * 10,
    ]
    for model, batch, mode, t in rows:
        quiet = by.get((model, batch, "clipped_sum"))
        noisy = quiet is not None and mode.startswith("clipped_sum+")
        noise = ms(t["compute"] - quiet["compute"]) if noisy else ""
        out.append(
            f"| {model} | {batch} | {mode} | {t['request KB']:.1f} | "
            f"{t['response KB']:.1f}, {t['messages']:.0f} | "
            + " | ".join(ms(t[p]) for p in ("encode", "prepare", "compute"))
            + f" | {noise} | "
            + " | ".join(ms(t[p]) for p in ("respond", "decode", "grpc", "remote"))
            + " |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mnist_mlp", "mnist_cnn"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--as-stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        serve_echo(as_stream=args.as_stream)
        return
    one_blas_thread()  # the in-process engine as `pergrad serve` runs it
    registry = build_registry(Config(models=tuple(args.models), jit_compile="off"))
    echo, echo_target = spawn(str(Path(__file__).resolve()), "--echo-server")
    rows = []
    try:
        echo_channel = grpc.insecure_channel(
            echo_target, options=[("grpc.max_receive_message_length", -1)]
        )
        for model in args.models:
            served = registry.get(model)
            with (
                LocalServer("--model", model, "--jit-compile", "off") as server,
                GradientClient(server.target, timeout=300) as client,
            ):
                for batch in args.batch_sizes:
                    for mode in args.modes:
                        times = measure_cell(
                            served, client, echo_channel, batch, mode, args.repeats
                        )
                        rows.append((model, batch, mode, times))
                        print(
                            f"{model} B={batch} {mode}: {ms(times['remote'])} ms", file=sys.stderr
                        )
    finally:
        echo.kill()
    print(tables(rows))


if __name__ == "__main__":
    main()
