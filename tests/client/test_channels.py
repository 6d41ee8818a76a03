"""Replicas a target names: resolved at first use, an unresolvable name a clear error; a
server that stops ends the calls in flight."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.client._channels import replica_addresses

UNRESOLVABLE = "dns:///pergrad.invalid:50051"  # RFC 6761: .invalid never resolves
# Callers with a call in flight as their server stops: gRPC's hang under a retry policy
# caught one run in two with 4 of them, here.
CALLERS = 8


def test_a_dns_target_names_each_address_it_resolves_to() -> None:
    assert "127.0.0.1:50051" in replica_addresses("dns:///localhost:50051")


def test_a_client_is_made_before_its_name_resolves_and_its_first_call_says_why() -> None:
    with (
        GradientClient(UNRESOLVABLE, timeout=5) as client,  # as gRPC's channels: lazily
        pytest.raises(PergradError) as err,
    ):
        _ = client.replicas
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cannot resolve 'pergrad.invalid'" in err.value.message


@pytest.mark.parametrize("method", ["per_example_gradients", "step"])
def test_calls_in_flight_when_their_server_stops_end_at_once(method: str) -> None:
    """Request-streaming calls (a chunked request) end when their server goes: under a
    retry policy gRPC could keep them waiting past their deadline, for ever."""
    from pergrad.server.main import start
    from tests.helpers import batch_for, loopback_config

    running = start(loopback_config("mnist_mlp"))
    x, y = batch_for((784,), 10, 64)
    ended: list[grpc.StatusCode] = []

    def call_until_refused() -> None:
        with GradientClient(f"127.0.0.1:{running.port}", timeout=20) as client:
            compute = getattr(client, method)
            options = {"learning_rate": 0.1, "max_norm": 1.0} if method == "step" else {}
            while True:
                try:
                    compute("mnist_mlp", x, y, **options)
                except PergradError as err:
                    ended.append(err.code)
                    return

    callers = [threading.Thread(target=call_until_refused) for _ in range(CALLERS)]
    for caller in callers:
        caller.start()
    time.sleep(2.0)
    running.stop(0)
    began = time.monotonic()
    for caller in callers:
        caller.join(15)
    waited = time.monotonic() - began
    assert len(ended) == CALLERS, f"{CALLERS - len(ended)} calls still waiting {waited:.0f} s on"
    assert set(ended) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
