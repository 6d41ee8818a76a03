"""`make bench`: an honest client's latency while each hostile caller of issue 23 works.

One `pergrad serve` with its default flags (every built-in model, XLA where it helps) but
for small requests sharing passes (`--max-coalesced-batch 128`, the default where a GPU
is seen: row 9 attacks the shared passes), and three tokens: the honest client's,
another writer's (the careless one of rows 10 and 13) and a reader's (`:ro`, every
other attack that needs a token). For each attack, in the order of the issue's table,
then the ways in found since (rows 15 to 17, and 19 and 20 on chunked requests; row 18
is a heavy caller, not a hostile one; row 0 is no attack: a flood of calls that are
answered, the reference for the floods of refused ones): the honest probes with the
server idle,
then again while the attack runs in a process of its own (its Python shares nothing
with the honest client's), then the attack is killed and the server left a moment to
let go of it. Every round times each probe once:

  check         a health Check (what Kubernetes' probes call)
  list          ListModels
  mlp           norms of 8 examples of mnist_mlp
  transformer   norms of 8 examples of transformer_block (the attacks on embeddings and on
                a model's shared passes aim at it)
  set_weights   mnist_mlp's own weights written back (the attacks on stream places and
                versions aim at updates)
  scrape        GET /metrics

The table gives, per probe, its idle and attacked medians in ms; the worst ratio of the
two over the probes; the honest calls that failed; the server's RSS (idle median, and
peak under attack); and the server's CPU time under attack over the calls it answered
meanwhile (the attacker's and the probes'): what each refused call of a flood costs it.

With `--open-services-port`, the server gives health and reflection a port of their own
(the check probe, and the attacks on them, go there).

  python benchmarks/attacks.py [--rows 1 2 9] [--rounds 10] [--open-services-port]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import numpy as np

from pergrad.client import GradientClient, PergradError
from pergrad.client.local import LocalServer
from pergrad.server.config import AUTO_COALESCED_BATCH
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunked_requests import MESSAGE_BYTES, in_chunks
from pergrad.wire.codec import encode_tensor, iter_chunks, tensor_spec

WRITER, CARELESS_WRITER, READER = "secret", "careless", "reader"
SERVICE = "/pergrad.v1.GradientService/"
HEALTH = "/grpc.health.v1.Health/"
HANDLED = "grpc_server_handled_total{"  # the server's calls answered, by method and status
VOCABULARY, SEQUENCE = 1000, 32  # transformer_block's token ids
WARM_UP_S = 3.0  # an attack takes hold (silent calls are evictable after 0.5 s)
SETTLE_S = 1.0  # the server lets go of a killed attacker's calls
PROBE_TIMEOUT_S = 30.0


def _bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _batch(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((size, 784)).astype(np.float32), rng.integers(0, 10, size)


def _tokens(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCABULARY, (size, SEQUENCE)), rng.integers(0, 2, size)


# --- the attacks: each runs in a process of its own until `stop` is set ---------------


def _hold_open(
    target: str, method: str, token: str | None, count: int, stop: threading.Event
) -> None:
    """Keep `count` calls of `method` open that never send their request, opening a new
    one whenever the server ends one (the attack renews itself)."""

    def silent() -> Iterator[bytes]:
        stop.wait()
        yield from ()

    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(method)
        calls: list[Any] = []
        while not stop.wait(0.2):
            calls = [c for c in calls if not c.done()]
            calls += [call(silent(), metadata=_bearer(token)) for _ in range(count - len(calls))]
        for c in calls:
            c.cancel()


def _in_loops(threads: int, body: Callable[[], None], stop: threading.Event) -> None:
    """Run `body` over and over on `threads` threads, ignoring how each call ends."""

    def loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError):
                body()

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    stop.wait()


def _unary(target: str, method: str, request: bytes, token: str | None) -> Callable[[], None]:
    """One call of a method taking one request, its responses read and dropped."""
    channel = grpc.insecure_channel(target)
    call = channel.unary_stream(method)

    def body() -> None:
        for _ in call(request, metadata=_bearer(token), timeout=PROBE_TIMEOUT_S):
            pass

    return body


def _gradients(model: str, x: np.ndarray, y: np.ndarray, **fields: Any) -> bytes:
    request = pb.GradientsRequest(model=model, inputs=encode_tensor(x), labels=encode_tensor(y))
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request.SerializeToString()


def answered_health_checks(target: str, metrics_url: str, stop: threading.Event) -> None:
    """Row 0, no attack but a reference for the floods below: 4 callers of health Check
    in tight loops, each call answered; what any flood of cheap calls from a process on
    the same cores costs an honest client."""
    check = grpc.insecure_channel(target).unary_unary(HEALTH + "Check")
    _in_loops(4, lambda: check(b"", timeout=PROBE_TIMEOUT_S), stop)


def large_health_checks(target: str, metrics_url: str, stop: threading.Event) -> None:
    """8 callers without a token, each on a connection of its own, sending health Checks
    of 57 MiB (an unknown field: a valid request) in tight loops."""
    # A Tensor's bytes: its field 3 is one HealthCheckRequest does not declare.
    request = tensor_pb2.Tensor(content=bytes(57 << 20)).SerializeToString()

    def body() -> None:
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        check = channel.unary_unary(HEALTH + "Check")
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError):
                check(request, timeout=PROBE_TIMEOUT_S)

    for _ in range(8):
        threading.Thread(target=body, daemon=True).start()
    stop.wait()


def silent_health_checks(target: str, metrics_url: str, stop: threading.Event) -> None:
    _hold_open(target, HEALTH + "Check", None, 70, stop)


def silent_gradients_calls(target: str, metrics_url: str, stop: threading.Event) -> None:
    _hold_open(target, SERVICE + "ComputePerExampleGradients", READER, 24, stop)


def reader_takes_stream_places(target: str, metrics_url: str, stop: threading.Event) -> None:
    _hold_open(target, SERVICE + "StreamPerExampleGradients", READER, 4, stop)


def ids_outside_the_vocabulary(target: str, metrics_url: str, stop: threading.Event) -> None:
    ids, y = _tokens(8, seed=1)
    ids[::2, 0], ids[1::2, 0] = VOCABULARY, -1
    request = _gradients("transformer_block", ids, y, reduction=pb.REDUCTION_NORMS)
    _in_loops(4, _unary(target, SERVICE + "ComputePerExampleGradients", request, READER), stop)


def streams_beyond_their_places(target: str, metrics_url: str, stop: threading.Event) -> None:
    _hold_open(target, SERVICE + "StreamPerExampleGradients", READER, 20, stop)


def trickling_metrics_connections(target: str, metrics_url: str, stop: threading.Event) -> None:
    """16 connections to /metrics, each sending one byte of a request every 5 s."""
    address = urlparse(metrics_url)
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"

    def trickle() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((address.hostname, address.port)) as sock:
                    for byte in head:
                        sock.sendall(bytes([byte]))
                        if stop.wait(5):
                            return
            except OSError:
                stop.wait(0.1)

    for _ in range(16):
        threading.Thread(target=trickle, daemon=True).start()
    stop.wait()


def calls_without_a_valid_token(target: str, metrics_url: str, stop: threading.Event) -> None:
    for token in (None, "guess"):
        threading.Thread(
            target=_hold_open,
            args=(target, SERVICE + "GetModelInfo", token, 24, stop),
            daemon=True,
        ).start()
    stop.wait()


def large_requests(target: str, metrics_url: str, stop: threading.Event) -> None:
    """8 callers each sending 57 MiB requests (19,000 examples of mnist_mlp) for norms."""
    x, y = _batch(19_000)
    request = _gradients("mnist_mlp", x, y, reduction=pb.REDUCTION_NORMS)
    _in_loops(8, _unary(target, SERVICE + "ComputePerExampleGradients", request, READER), stop)


def _once_admitted(ask: Callable[[GradientClient], Any], target: str) -> Any:
    """What the reader's client answers, once the server no longer refuses the token's
    calls unread (an earlier row's refusals count against it for up to 11 s)."""
    deadline = time.monotonic() + 30
    with GradientClient(target, token=READER) as client:
        while True:
            try:
                return ask(client)
            except PergradError as err:
                if "refused unread" not in err.message or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _at_the_limit(target: str, labels_short: bool) -> bytes:
    """A norms request of mnist_mlp in one message as large as the server takes (its
    ModelInfo.limits, within the bound on a message), a label short (refused once read)
    or whole."""
    info = _once_admitted(lambda c: c.model_info("mnist_mlp"), target)
    largest = min(info.limits.max_request_bytes, MESSAGE_BYTES)
    x, y = _batch((largest - 4096) // (784 * 4 + 8))
    return _gradients("mnist_mlp", x, y[:-1] if labels_short else y, reduction=pb.REDUCTION_NORMS)


def requests_at_the_message_limit(target: str, metrics_url: str, stop: threading.Event) -> None:
    """8 callers each sending the largest gradients request the server takes, refused
    once read."""
    request = _at_the_limit(target, labels_short=True)
    _in_loops(8, _unary(target, SERVICE + "ComputePerExampleGradients", request, READER), stop)


def _chunked(target: str, method: str, messages: list[bytes], token: str | None) -> Callable:
    """One call of a method taking one request, sent as these messages (a chunked
    request), its responses read and dropped."""
    channel = grpc.insecure_channel(target)
    call = channel.stream_stream(method)

    def body() -> None:
        for _ in call(iter(messages), metadata=_bearer(token), timeout=PROBE_TIMEOUT_S):
            pass

    return body


def chunked_requests_refused_once_read(
    target: str, metrics_url: str, stop: threading.Event
) -> None:
    """8 callers each sending, in chunks, the largest gradients request the server takes
    (--max-request-bytes), a label short: read whole, then refused."""
    info = _once_admitted(lambda c: c.model_info("mnist_mlp"), target)
    x, y = _batch((info.limits.max_request_bytes - 4096) // (784 * 4 + 8))
    request = pb.GradientsRequest.FromString(_gradients("mnist_mlp", x, y[:-1]))
    messages = [m if isinstance(m, bytes) else m.SerializeToString() for m in in_chunks(request)]
    method = SERVICE + "ComputePerExampleGradients"
    _in_loops(8, _chunked(target, method, messages, READER), stop)


def chunked_requests_declaring_a_gib(target: str, metrics_url: str, stop: threading.Event) -> None:
    """8 callers each sending a first message that declares 1 GiB of inputs in chunks,
    then none: refused from that message."""
    x, y = _batch(2)
    request = pb.GradientsRequest.FromString(_gradients("mnist_mlp", x, y))
    request.inputs.CopyFrom(tensor_pb2.Tensor(dtype=1, shape=[1 << 18, 1024], chunked=True))
    method = SERVICE + "ComputePerExampleGradients"
    _in_loops(8, _chunked(target, method, [request.SerializeToString()], READER), stop)


def answered_requests_at_the_message_limit(
    target: str, metrics_url: str, stop: threading.Event
) -> None:
    """8 callers each sending the largest gradients request the server takes, answered:
    a heavy caller, not a hostile one (what its share of the workers leaves the others)."""
    request = _at_the_limit(target, labels_short=False)
    _in_loops(8, _unary(target, SERVICE + "ComputePerExampleGradients", request, READER), stop)


def expensive_small_requests(target: str, metrics_url: str, stop: threading.Event) -> None:
    """4 callers of the reader's token each keeping a 127-example request (just below the
    coalescing size) of transformer_block in flight."""
    ids, y = _tokens(127, seed=2)
    request = _gradients("transformer_block", ids, y, reduction=pb.REDUCTION_NORMS)
    _in_loops(4, _unary(target, SERVICE + "ComputePerExampleGradients", request, READER), stop)


def many_small_fields(target: str, metrics_url: str, stop: threading.Event) -> None:
    """2 callers of the reader's token alternating two gradients requests of many small
    fields, each under 1 MiB: 80,000 `dot` references, and 80,000 variable names."""
    x, y = _batch(8)
    references = pb.GradientsRequest(model="mnist_mlp", reduction=pb.REDUCTION_DOT)
    for i in range(80_000):
        references.reference[f"v{i}"].CopyFrom(tensor_pb2.Tensor())
    names = _gradients(
        "mnist_mlp", x, y, reduction=pb.REDUCTION_NORMS, variables=[f"v{i}" for i in range(80_000)]
    )
    method = SERVICE + "ComputePerExampleGradients"
    bodies = [
        _unary(target, method, request, READER)
        for request in (references.SerializeToString(), names)
    ]

    def both() -> None:
        for body in bodies:
            body()

    _in_loops(2, both, stop)


def _set_weights(target: str, messages: list[pb.WeightsMessage]) -> Callable[[], None]:
    """One SetWeights of these messages by a writer other than the honest client."""
    channel = grpc.insecure_channel(target)
    call = channel.stream_unary(SERVICE + "SetWeights")
    sent = [message.SerializeToString() for message in messages]

    def body() -> None:
        call(iter(sent), metadata=_bearer(CARELESS_WRITER), timeout=PROBE_TIMEOUT_S)

    return body


def header_of_60000_names(target: str, metrics_url: str, stop: threading.Event) -> None:
    specs = [tensor_pb2.TensorSpec(name=f"t{i}", dtype=1, shape=[1]) for i in range(60_000)]
    header = pb.WeightsHeader(model="mnist_mlp", tensors=specs)
    _in_loops(2, _set_weights(target, [pb.WeightsMessage(header=header)]), stop)


def huge_model_names(target: str, metrics_url: str, stop: threading.Event) -> None:
    request = pb.GetModelInfoRequest(model="m" * (1 << 20)).SerializeToString()
    _in_loops(2, _unary(target, SERVICE + "GetModelInfo", request, READER), stop)


def bad_dot_references(target: str, metrics_url: str, stop: threading.Event) -> None:
    x, y = _batch(8)
    nan = np.full((2, 10), np.nan, np.float32)
    scalar = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[], content=b"\0" * 4)
    bodies = []
    for reference in (encode_tensor(nan), scalar):
        request = pb.GradientsRequest(
            model="mnist_mlp",
            inputs=encode_tensor(x),
            labels=encode_tensor(y),
            reduction=pb.REDUCTION_DOT,
            variables=["logits/bias"],
        )
        request.reference["logits/bias"].CopyFrom(reference)
        method = SERVICE + "ComputePerExampleGradients"
        bodies.append(_unary(target, method, request.SerializeToString(), READER))

    def both() -> None:
        for body in bodies:
            body()

    _in_loops(2, both, stop)


def versions_far_ahead(target: str, metrics_url: str, stop: threading.Event) -> None:
    _, weights = _once_admitted(lambda c: c.get_weights("mnist_mlp"), target)
    header = pb.WeightsHeader(
        model="mnist_mlp",
        new_version=2**62,
        tensors=[tensor_spec(name, array) for name, array in weights.items()],
    )
    chunks = [
        pb.WeightsMessage(chunk=chunk)
        for index, array in enumerate(weights.values())
        for chunk in iter_chunks(index, array)
    ]
    _in_loops(2, _set_weights(target, [pb.WeightsMessage(header=header), *chunks]), stop)


def watches_cancelled_as_they_open(target: str, metrics_url: str, stop: threading.Event) -> None:
    channel = grpc.insecure_channel(target)
    watch = channel.unary_stream(HEALTH + "Watch")

    def body() -> None:
        watch(b"", timeout=PROBE_TIMEOUT_S).cancel()

    _in_loops(4, body, stop)


# The attacks on health and reflection: sent where those answer (`--open-services-port`).
ON_OPEN_SERVICES = {
    answered_health_checks,
    silent_health_checks,
    watches_cancelled_as_they_open,
    large_health_checks,
}

ATTACKS: dict[int, tuple[str, Callable[[str, str, threading.Event], None]]] = {
    0: ("reference: 4 callers of health Check in tight loops, answered", answered_health_checks),
    1: ("70 health Checks that never send their request, no token", silent_health_checks),
    2: ("24 gradients calls of a reader that never send their request", silent_gradients_calls),
    3: ("a reader holds 4 idle gradient streams", reader_takes_stream_places),
    4: ("token ids outside the vocabulary (1000, -1), 4 callers", ids_outside_the_vocabulary),
    5: ("20 idle gradient streams of a reader", streams_beyond_their_places),
    6: ("16 /metrics connections sending a byte every 5 s", trickling_metrics_connections),
    7: ("48 silent calls with no token or a wrong one", calls_without_a_valid_token),
    8: ("8 callers sending 57 MiB requests", large_requests),
    9: ("4 callers of one reader keep 127-example requests in flight", expensive_small_requests),
    10: ("SetWeights headers declaring 60,000 names, 2 callers", header_of_60000_names),
    11: ("1 MiB model names, 2 callers", huge_model_names),
    12: ("dot references holding NaN or of no shape, 2 callers", bad_dot_references),
    13: ("SetWeights to version 2^62, 2 callers", versions_far_ahead),
    14: ("health Watches cancelled as they open, 4 callers", watches_cancelled_as_they_open),
    15: (
        "requests of 80,000 small fields (dot references, variable names), 2 callers",
        many_small_fields,
    ),
    16: ("8 callers without a token sending 57 MiB health Checks", large_health_checks),
    17: (
        "8 callers sending requests at the message limit, refused once read",
        requests_at_the_message_limit,
    ),
    18: (
        "8 callers sending requests at the message limit, answered",
        answered_requests_at_the_message_limit,
    ),
    19: (
        "8 callers sending chunked requests at --max-request-bytes, refused once read",
        chunked_requests_refused_once_read,
    ),
    20: ("8 callers declaring 1 GiB in chunks and sending none", chunked_requests_declaring_a_gib),
}


def _attack_process(row: int, target: str, metrics_url: str) -> None:
    """The attacker's process: the row's attack, until the process is killed."""
    ATTACKS[row][1](target, metrics_url, threading.Event())


# --- the honest client ---------------------------------------------------------------


class Honest:
    """The probes, each a callable timed once a round; failures are counted, not timed."""

    def __init__(self, server: LocalServer) -> None:
        self.client = GradientClient(server.target, token=WRITER, timeout=PROBE_TIMEOUT_S)
        self.channel = grpc.insecure_channel(server.health_target)
        self.health_target = server.health_target
        self.metrics_url = server.metrics_url
        self.pid = server.process.pid
        _, self.weights = self.client.get_weights("mnist_mlp")
        x, y = _batch(8)
        ids, labels = _tokens(8)
        check = self.channel.unary_unary(HEALTH + "Check")
        self.probes: dict[str, Callable[[], object]] = {
            "check": lambda: check(b"", timeout=PROBE_TIMEOUT_S),
            "list": self.client.list_models,
            "mlp": lambda: self.client.per_example_gradients("mnist_mlp", x, y, reduction="norms"),
            "transformer": lambda: self.client.per_example_gradients(
                "transformer_block", ids, labels, reduction="norms"
            ),
            "set_weights": lambda: self.client.set_weights("mnist_mlp", self.weights),
            "scrape": lambda: urllib.request.urlopen(
                self.metrics_url, timeout=PROBE_TIMEOUT_S
            ).read(),
        }

    def close(self) -> None:
        self.client.close()
        self.channel.close()

    def cpu_s(self) -> float:
        """The server's CPU time so far (user and system), in seconds."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def calls_ended(self) -> float:
        """Calls the server has answered so far, every method and status."""
        with urllib.request.urlopen(self.metrics_url, timeout=PROBE_TIMEOUT_S) as reply:
            lines = reply.read().decode().splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith(HANDLED))

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
        return int(kb) / 1024

    def rounds(self, count: int) -> tuple[dict[str, list[float]], Counter[str], list[float]]:
        """({probe: seconds of the calls that succeeded}, failures by probe and status,
        RSS samples)."""
        times: dict[str, list[float]] = {name: [] for name in self.probes}
        failed: Counter[str] = Counter()
        rss = []
        for _ in range(count):
            for name, probe in self.probes.items():
                start = time.perf_counter()
                try:
                    probe()
                except Exception as err:  # any failure of an honest call counts
                    failed[f"{name} {_status(err)}"] += 1
                    continue
                times[name].append(time.perf_counter() - start)
            rss.append(self.rss_mb())
        return times, failed, rss


def _status(err: Exception) -> str:
    code = getattr(err, "code", None)
    code = code() if callable(code) else code
    return code.name if isinstance(code, grpc.StatusCode) else type(err).__name__


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000 if times else float("nan")


def _row(row: int, honest: Honest, target: str, rounds: int) -> str:
    idle, _, idle_rss = honest.rounds(rounds)
    spawn = multiprocessing.get_context("spawn")
    if ATTACKS[row][1] in ON_OPEN_SERVICES:
        target = honest.health_target
    attacker = spawn.Process(
        target=_attack_process, args=(row, target, honest.metrics_url), daemon=True
    )
    attacker.start()
    time.sleep(WARM_UP_S)
    cpu, calls = honest.cpu_s(), honest.calls_ended()
    attacked, failed, attacked_rss = honest.rounds(rounds)
    cpu, calls = honest.cpu_s() - cpu, honest.calls_ended() - calls
    # Killed, not told to stop by a multiprocessing event: one whose process had died
    # early left the event's notify waiting for it forever (a run hung so).
    attacker.kill()
    attacker.join()
    time.sleep(SETTLE_S)
    cells, ratios = [], []
    for name in honest.probes:
        before, after = _median_ms(idle[name]), _median_ms(attacked[name])
        cells.append(f"{before:.1f} → {after:.1f}")
        ratios.append(after / before)
    worst = max(ratios)
    failures = ", ".join(f"{what}: {n}" for what, n in failed.items())
    return (
        f"| {row} | {ATTACKS[row][0]} | {' | '.join(cells)} | {worst:.2f} | "
        f"{sum(failed.values())}/{rounds * len(honest.probes)} {failures} | "
        f"{statistics.median(idle_rss):.0f} → {max(attacked_rss):.0f} | "
        f"{1000 * cpu / max(calls, 1):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--open-services-port",
        action="store_true",
        help="give health and reflection a port of their own (the attacks on them go there)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(f"{WRITER}\n{CARELESS_WRITER}\n{READER}:ro\n")
        sharing = ("--max-coalesced-batch", str(AUTO_COALESCED_BATCH))
        own_port = ("--open-services-port", "0") if args.open_services_port else ()
        with LocalServer("--auth-token-file", str(tokens), *sharing, *own_port) as server:
            honest = Honest(server)
            honest.rounds(2)  # traces and compiles
            names = " | ".join(f"{name} ms" for name in honest.probes)
            print(
                f"| # | attack | {names} | worst ratio | honest failed | server RSS MB | "
                "server CPU ms per call ended |"
            )
            print("| ---: | --- |" + " ---: |" * (len(honest.probes) + 4))
            for row in args.rows:
                print(_row(row, honest, server.target, args.rounds), flush=True)
            honest.close()


if __name__ == "__main__":
    main()
