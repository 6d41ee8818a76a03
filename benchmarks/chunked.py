"""A request in one message against the same request in chunks (issue 43: requests
travel as results and weights do), on one server, raw calls taking turns; medians.

  one message    the request serialized once, every tensor inline (at most 4 MiB)
  chunks         the same request as `in_chunks` sends it, split beforehand: what the
                 server's reading of its chunks costs
  built + sent   the request built as the client builds it (its tensors arrays beside
                 its message), split by `in_chunks` and sent as the client does (past
                 3 MiB inline; here past 1 MiB, so that every size goes in chunks)

A request over 4 MiB (B=4096: 12 MiB) travels in chunks only; its row times those alone
(the server takes up to 64 MiB here; by default, 4 MiB and what one request to a served
model cannot split: a step's gradient sum, `dot`'s references, one example).

Then, in this process, what the copies of a request's bytes cost either side: the
client's building of the request and making of its messages, the server's reading of
them whole (parsed, chunks assembled, every tensor an array), against one copy of its
tensors' bytes into new arrays.

    python benchmarks/chunked.py [--rounds 41] [--batch-sizes 384 1024 4096]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc
import numpy as np

from pergrad.client.local import LocalServer
from pergrad.server.engine.cores import one_blas_thread
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunked_requests import (
    MESSAGE_BYTES,
    Chunked,
    Whole,
    in_chunks,
    tensor_keys,
)
from pergrad.wire.messages import gradients_request
from pergrad.wire.terms import Reduction

METHOD = "/pergrad.v1.GradientService/ComputePerExampleGradients"
# Inline at most this, below the client's 3 MiB, so that both sizes go in chunks.
INLINE_BYTES = 1 << 20


def _serialized(messages: list) -> list[bytes]:
    return [m if isinstance(m, bytes) else m.SerializeToString() for m in messages]


def medians(call: Callable, build: Callable[[], Whole], rounds: int) -> dict[str, float]:
    """ms of each way of sending the request `build` makes, the ways taking turns (a first
    round warms)."""
    request = build()
    whole = [request.inline().SerializeToString()]
    chunks = _serialized(in_chunks(request, inline_bytes=INLINE_BYTES))
    ways: dict[str, Callable[[], list[bytes]]] = {
        "one": lambda: whole,
        "chunks": lambda: chunks,
        "split": lambda: _serialized(in_chunks(build(), inline_bytes=INLINE_BYTES)),
    }
    if len(whole[0]) > MESSAGE_BYTES:
        del ways["one"]  # the server takes no message this large
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds + 1):
        for name, messages in ways.items():
            began = time.perf_counter()
            for _ in call(iter(messages()), timeout=60):
                pass
            if round_:
                times[name].append(time.perf_counter() - began)
    ms = {"one": math.nan} | {name: 1000 * statistics.median(t) for name, t in times.items()}
    return ms | {"mib": len(whole[0]) / 2**20, "messages": len(chunks)}


def in_process(build: Callable[[], Whole], rounds: int) -> dict[str, float]:
    """ms, in this process, the three taking turns: the client's building of the request
    and making of its messages (`in_chunks`, at the client's 3 MiB inline), the server's
    reading of them whole (parsed, chunks assembled, every tensor an array), and a copy of
    its tensors' bytes into new arrays (the floor of either)."""
    messages = _serialized(in_chunks(build()))
    arrays = list(build().arrays.values())

    def read() -> list[np.ndarray]:
        parsed = [pb.GradientsRequest.FromString(m) for m in messages]
        chunked = Chunked(parsed[0])
        for message, data in zip(parsed[1:], messages[1:], strict=True):
            chunked.add(message, len(data))
        whole = chunked.whole()
        return [whole.array(tensor, key) for key, tensor in tensor_keys(whole.message)]

    ways = {
        "client": lambda: _serialized(in_chunks(build())),
        "read": read,
        "copy": lambda: [np.array(a) for a in arrays],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds + 1):
        for name, way in ways.items():
            began = time.perf_counter()
            way()
            if round_:
                times[name].append(time.perf_counter() - began)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[384, 1024, 4096])
    args = parser.parse_args()
    one_blas_thread()
    norms = CATALOGUE.get("norms")
    builds = {size: _build(size, norms) for size in args.batch_sizes}
    print(
        "| B (mnist_mlp, norms) | request MiB | messages in chunks | one message ms | chunks ms "
        "| built + sent ms |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    with (
        LocalServer(
            "--model", "mnist_mlp", "--jit-compile", "off", "--max-request-bytes", str(64 << 20)
        ) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        call = channel.stream_stream(METHOD)
        for size, build in builds.items():
            ms = medians(call, build, args.rounds)
            print(
                f"| {size} | {ms['mib']:.2f} | {ms['messages']:.0f} | {_ms(ms['one'])} | "
                f"{ms['chunks']:.2f} | {ms['split']:.2f} |"
            )
    print("\n| B | client: built, made into messages ms | server: read whole ms | a copy ms |")
    print("| ---: | ---: | ---: | ---: |")
    for size, build in builds.items():
        ms = in_process(build, args.rounds)
        print(f"| {size} | {ms['client']:.2f} | {ms['read']:.2f} | {ms['copy']:.2f} |")


def _build(size: int, reduction: Reduction) -> Callable[[], Whole]:
    """A request of `size` mnist_mlp examples, built afresh at each call."""
    rng = np.random.default_rng(size)
    x = rng.standard_normal((size, 784)).astype(np.float32)
    y = rng.integers(0, 10, size).astype(np.int32)
    return functools.partial(gradients_request, "mnist_mlp", x, y, reduction=reduction, options={})


if __name__ == "__main__":
    main()
