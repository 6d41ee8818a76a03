"""`make bench` (small_floor): issue 44's small callers against the floor of their wire.

`load.py`'s clients (16 processes sending mnist_mlp requests of B=8 back to back, each a
`GradientClient`) against four servers of mnist_mlp (`--jit-compile off`), and one client
of B=128 against `pergrad serve` (issue 44's reference), in alternating rounds of one run:

  pergrad     `pergrad serve`, every other flag its default (coalescing off on a CPU)
  engine      a bare grpcio server (no interceptors, guard, pools, stall timer or metrics)
              whose handler does what pergrad's does for a gradients call: parse the
              request, `gradients.prepare`, `gradients.responses` (admission, the pass, the
              reduction and its noise, the encoding)
  echo        the same bare server answering each request with its responses made once:
              the wire and the clients alone, what no server of these bytes on grpcio's
              sync Python server can go below on this machine
  aio echo    the echo on grpc.aio's asyncio server: whether an asyncio entrance would
              lift that ceiling

Each server's 16 x B=8 examples/s over pergrad's 1 x B=128 is issue 44's ratio (>= 0.5
asked); the echo's is the ceiling any server reaches with these clients on this machine's
cores, which they share with the server as `load.py --small`'s do. The server's CPU an
example (its process's threads, /proc, from before the clients start to their end: their
connecting and the last calls' ends included) gives the ratio a server would reach were
its cores its own and its callers elsewhere: pergrad's at B=128 over each server's at B=8.

    python benchmarks/small_floor.py [--clients 16] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import REFERENCE_BATCH, SMALL_BATCHES, SMALL_REDUCTIONS, small_run, warm_small
from server_cpu import cpu_by_kind, thread_cpu
from transport import announce, pergrad_server, serve_handler, spawn

from pergrad.wire.rpc import SERVICE_NAME

MODEL = "mnist_mlp"
BARE = {"engine": False, "echo": False, "aio echo": True}  # kind: on grpc.aio
_IDENTITY = bytes  # the bare servers' messages are bytes both ways


def _answers(kind: str) -> tuple[bytes, Callable[[bytes], list[bytes]]]:
    """mnist_mlp's ModelInfo as pergrad answers it, and a gradients request's response
    messages as pergrad's per-call functions make them (each request's once, but for the
    engine)."""
    from pergrad.server.admission.inflight import Admission
    from pergrad.server.admission.unparsed import request_bytes_limit
    from pergrad.server.config import Config
    from pergrad.server.devices import with_coalescing_resolved
    from pergrad.server.engine.cores import one_blas_thread
    from pergrad.server.gradients import Charge, Settings, prepare, responses
    from pergrad.server.main import build_registry
    from pergrad.server.model_info import model_info
    from pergrad.v1 import gradient_service_pb2 as pb
    from pergrad.wire.chunked_requests import Whole
    from pergrad.wire.chunks import serialize

    one_blas_thread()
    config = with_coalescing_resolved(Config(models=(MODEL,), jit_compile="off"))
    registry = build_registry(config)
    served = registry.get(MODEL)
    info = model_info(served, config, request_bytes_limit(config, registry))
    settings = Settings.of(config)
    admission = Admission(
        max_examples=config.max_inflight_examples, max_bytes=config.max_inflight_bytes
    )
    charge = Charge(admission, lambda: False)

    def gradients(raw: bytes) -> list[bytes]:
        request = pb.GradientsRequest.FromString(raw)
        work = prepare(served, Whole(request), settings)
        return [serialize(m) for m in responses(work, request.request_id, settings, charge)]

    return info.SerializeToString(), gradients if kind == "engine" else functools.cache(gradients)


def _handler(
    info: bytes, gradients: Callable[[bytes], list[bytes]], aio: bool
) -> grpc.GenericRpcHandler:
    if aio:

        async def info_of(raw: bytes, context: object) -> bytes:
            return info

        async def compute(raw: bytes, context: object) -> AsyncIterator[bytes]:
            for message in gradients(raw):
                yield message

    else:

        def info_of(raw: bytes, context: object) -> bytes:
            return info

        def compute(raw: bytes, context: object) -> Iterator[bytes]:
            return iter(gradients(raw))

    kinds = {"request_deserializer": _IDENTITY, "response_serializer": _IDENTITY}
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(info_of, **kinds),
            "ComputePerExampleGradients": grpc.unary_stream_rpc_method_handler(compute, **kinds),
        },
    )


def serve(kind: str) -> None:
    """A bare server of `kind`: prints its ready line (`transport.spawn`), serves until
    killed."""
    aio = BARE[kind]
    handler = _handler(*_answers(kind), aio)
    if not aio:
        serve_handler(handler, threads=8)
        return

    async def run() -> None:
        server = grpc.aio.server(handlers=[handler])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        announce(port)
        await server.wait_for_termination()

    asyncio.run(run())


def _run(server: tuple, batch: int, clients: int, reduction: str, seconds: float) -> tuple:
    """(examples/s, p50 s, the server's CPU seconds an example) of one `load.py` run."""
    process, target = server
    before = thread_cpu(process.pid)
    rate, p50, _ = small_run(target, MODEL, reduction, batch, clients, seconds)
    cpu = sum(cpu_by_kind(before, thread_cpu(process.pid)).values())
    return rate, p50, cpu / (rate * seconds)


def _rows(reduction: str, one: list[tuple], many: dict[str, list[tuple]]) -> list[str]:
    large, large_cpu = (statistics.median(run[k] for run in one) for k in (0, 2))
    rows = []
    for kind, runs in many.items():
        small, p50, cpu = (statistics.median(run[k] for run in runs) for k in range(3))
        rows.append(
            f"| {reduction} | {large:.0f} | {kind} | {small:.0f} | {small / large:.2f} | "
            f"{1000 * p50:.1f} | {1e6 * large_cpu:.1f} | {1e6 * cpu:.1f} | "
            f"{large_cpu / cpu:.2f} |"
        )
    return rows


def measure(clients: int, seconds: float, rounds: int) -> list[str]:
    """The table's rows: for each reduction, pergrad's 1 x B=128 and each server's
    `clients` x B=8, medians of `rounds` alternating rounds."""
    servers = {"pergrad": pergrad_server("--model", MODEL, "--jit-compile", "off")}
    servers.update({kind: spawn(__file__, "--serve", kind) for kind in BARE})
    rows = []
    try:
        for _, target in servers.values():
            warm_small(target, MODEL, (SMALL_BATCHES[0], REFERENCE_BATCH))
        for reduction in SMALL_REDUCTIONS:
            one, many = [], {kind: [] for kind in servers}
            for _ in range(rounds):
                one.append(_run(servers["pergrad"], REFERENCE_BATCH, 1, reduction, seconds))
                for kind, server in servers.items():
                    many[kind].append(_run(server, SMALL_BATCHES[0], clients, reduction, seconds))
            rows += _rows(reduction, one, many)
    finally:
        for process, _ in servers.values():
            process.kill()
            process.wait(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", choices=list(BARE), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    rows = measure(args.clients, args.seconds, args.rounds)
    print(
        f"| reduction | pergrad 1 x B={REFERENCE_BATCH}, examples/s | server | {args.clients} "
        f"x B={SMALL_BATCHES[0]}, examples/s | / pergrad's B={REFERENCE_BATCH} | p50 ms | server "
        f"CPU us/example, B={REFERENCE_BATCH} | the same, B={SMALL_BATCHES[0]} | CPU ratio |  "
        f"(medians of {args.rounds} rounds of {args.seconds:.0f} s)"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
