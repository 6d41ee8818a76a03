"""Replicas a target names: resolved at first use, an unresolvable name a clear error."""

from __future__ import annotations

import grpc
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.client._channels import replica_addresses

UNRESOLVABLE = "dns:///pergrad.invalid:50051"  # RFC 6761: .invalid never resolves


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
