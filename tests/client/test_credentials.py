"""The client's credentials reach every channel it opens, under TLS and in plaintext.

Two real servers requiring a bearer token (and, for TLS, a client certificate) stand
behind one ipv4: target: a micro-batched call spreads over both through the shared
channel, and set_weights reaches each through a channel of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.client._channels import tls_name_options
from pergrad.client._credentials import Security
from pergrad.server.config import Config
from pergrad.server.main import RunningServer, start
from tests.helpers import batch_for, connect_both, loopback_config
from tests.pki import Pki, make_pki

TOKEN = "replica-token-5e1f"
TIMEOUT_S = 30
NAME_OVERRIDE = "grpc.ssl_target_name_override"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(TOKEN + "\n")
    return path


def replica_config(name: str, token_file: Path, pki: Pki | None) -> Config:
    """A 127.0.0.1 replica that wants the token, and mutual TLS when given a PKI."""
    tls: dict[str, Any] = {}
    if pki is not None:
        tls = {"tls_cert": pki.server.cert, "tls_key": pki.server.key}
        tls["tls_client_ca"] = pki.ca.cert
    return loopback_config(
        "mnist_mlp",
        replica_name=name,
        auth_token_file=token_file,
        **tls,
    )


def client_credentials(pki: Pki | None) -> dict[str, Any]:
    if pki is None:
        return {"token": TOKEN}
    return {
        "token": TOKEN,
        "root_certificates": pki.ca.cert,
        "certificate_chain": pki.client.cert,
        "private_key": pki.client.key,
        "server_name": "localhost",
    }


@pytest.fixture(params=["tls", "plaintext"])
def replicas(
    request: pytest.FixtureRequest, pki: Pki, token_file: Path
) -> Iterator[tuple[list[RunningServer], dict[str, Any]]]:
    """Two replicas and the credentials a client needs for them."""
    tls_pki = pki if request.param == "tls" else None
    running = [start(replica_config(f"r{i}", token_file, tls_pki)) for i in range(2)]
    yield running, client_credentials(tls_pki)
    for server in running:
        server.stop(0)


def spread_target(servers: list[RunningServer]) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def test_set_weights_reaches_every_replica_with_the_credentials(replicas) -> None:
    servers, credentials = replicas
    with GradientClient(spread_target(servers), timeout=TIMEOUT_S, **credentials) as client:
        version, weights = client.get_weights("mnist_mlp")
        new_version = client.set_weights("mnist_mlp", weights)
    versions = [
        s.metrics.registry.get_sample_value("pergrad_weights_version", {"model": "mnist_mlp"})
        for s in servers
    ]
    assert new_version == version + 1
    assert versions == [new_version, new_version]


def test_micro_batches_spread_over_replicas_with_the_credentials(replicas) -> None:
    servers, credentials = replicas
    x, y = batch_for((784,), 10, 8)
    target = spread_target(servers)
    with GradientClient(target, timeout=TIMEOUT_S, micro_batch=2, **credentials) as client:
        connect_both(client, "mnist_mlp", x, y)
        result = client.per_example_gradients("mnist_mlp", x, y)
    assert set(result.server.split(",")) == {"r0", "r1"}
    assert result.gradients["hidden/kernel"].shape == (8, 784, 128)


def test_replicas_refuse_a_client_without_the_token(replicas) -> None:
    servers, credentials = replicas
    credentials = {k: v for k, v in credentials.items() if k != "token"}
    client = GradientClient(spread_target(servers), timeout=TIMEOUT_S, **credentials)
    with client, pytest.raises(PergradError) as refused:
        client.list_models()
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_certificate_without_its_key_is_refused() -> None:
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        GradientClient("127.0.0.1:1", certificate_chain=b"-----BEGIN CERTIFICATE-----")


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="token is empty"):
        GradientClient("127.0.0.1:1", token=" ")


def test_tls_to_an_address_list_needs_a_server_name() -> None:
    with pytest.raises(ValueError, match="needs server_name="):
        GradientClient("ipv4:127.0.0.1:1,127.0.0.1:2", tls=True)


def test_certificate_argument_implies_tls() -> None:
    assert Security.of(root_certificates=b"-----BEGIN CERTIFICATE-----").tls


def test_pem_path_is_read_like_its_bytes(pki: Pki) -> None:
    by_path = Security.of(root_certificates=pki.ca.cert)
    assert by_path.root_certificates == pki.ca.cert.read_bytes()


def test_replicas_of_a_dns_target_are_checked_against_its_name() -> None:
    options = tls_name_options("dns:///pergrad-headless.ml.svc:50051", Security(tls=True))
    assert options == [(NAME_OVERRIDE, "pergrad-headless.ml.svc")]


def test_server_name_overrides_the_target_host() -> None:
    security = Security(tls=True, server_name="pergrad.example")
    assert tls_name_options("10.0.0.5:50051", security) == [(NAME_OVERRIDE, "pergrad.example")]


def test_plaintext_channels_get_no_name_override() -> None:
    assert tls_name_options("dns:///pergrad-headless.ml.svc:50051", Security()) == []
