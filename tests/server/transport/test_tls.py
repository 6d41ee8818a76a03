"""TLS and mutual TLS on real servers: who is refused, who computes gradients.

Certificates come from a throwaway CA made once for the module (`tests.pki`); the two
servers share one registry of `mnist_mlp`, as no test here changes weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.config import Config
from pergrad.server.main import RunningServer, build_registry, start
from pergrad.server.models.registry import ModelRegistry
from tests.helpers import batch_for, loopback_config
from tests.pki import Pki, make_pki
from tests.prometheus import sample_names, scrape

TIMEOUT_S = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def secure_config(pki: Pki, *, client_ca: Path | None = None) -> Config:
    """A 127.0.0.1 server with the PKI's server certificate (and `client_ca` for mTLS)."""
    return loopback_config(
        "mnist_mlp",
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=client_ca,
    )


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return build_registry(Config(models=("mnist_mlp",), jit_compile="off"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, registry: ModelRegistry) -> Iterator[RunningServer]:
    running = start(secure_config(pki), registry)
    yield running
    running.stop(0)


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, registry: ModelRegistry) -> Iterator[RunningServer]:
    running = start(secure_config(pki, client_ca=pki.ca.cert), registry)
    yield running
    running.stop(0)


def target(server: RunningServer) -> str:
    return f"127.0.0.1:{server.port}"


def refusal(server: RunningServer, **credentials: Any) -> grpc.StatusCode:
    """The status code of ListModels from a client with `credentials`; fails if it worked."""
    client = GradientClient(target(server), timeout=TIMEOUT_S, **credentials)
    with client, pytest.raises(PergradError) as refused:
        client.list_models()
    return refused.value.code


def computes_gradients(server: RunningServer, **credentials: Any) -> bool:
    """Whether a client with `credentials` gets one gradient per example back."""
    x, y = batch_for((784,), 10, 3)
    with GradientClient(target(server), timeout=TIMEOUT_S, **credentials) as client:
        result = client.per_example_gradients("mnist_mlp", x, y)
    return result.gradients["hidden/kernel"].shape == (3, 784, 128) and bool(
        np.all(np.isfinite(result.losses))
    )


def test_plaintext_client_is_refused(tls_server: RunningServer) -> None:
    assert refusal(tls_server) == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(tls_server: RunningServer, pki: Pki) -> None:
    assert refusal(tls_server, root_certificates=pki.other_ca.cert) == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_only_system_roots_is_refused(tls_server: RunningServer) -> None:
    assert refusal(tls_server, tls=True) == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_the_ca_computes_gradients(tls_server: RunningServer, pki: Pki) -> None:
    assert computes_gradients(tls_server, root_certificates=pki.ca.cert.read_bytes())


def test_ca_given_as_a_path_works_like_its_bytes(tls_server: RunningServer, pki: Pki) -> None:
    with GradientClient(
        target(tls_server), timeout=TIMEOUT_S, root_certificates=str(pki.ca.cert)
    ) as client:
        assert client.list_models() == ["mnist_mlp"]


def test_metrics_endpoint_stays_plain_http(tls_server: RunningServer) -> None:
    assert "grpc_server_handled_total" in sample_names(scrape(tls_server.metrics_port))


def test_mtls_client_without_certificate_is_refused(mtls_server: RunningServer, pki: Pki) -> None:
    assert refusal(mtls_server, root_certificates=pki.ca.cert) == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_certificate_from_another_ca_is_refused(
    mtls_server: RunningServer, pki: Pki
) -> None:
    code = refusal(
        mtls_server,
        root_certificates=pki.ca.cert,
        certificate_chain=pki.other_client.cert,
        private_key=pki.other_client.key,
    )
    assert code == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_a_certificate_of_the_ca_computes_gradients(
    mtls_server: RunningServer, pki: Pki
) -> None:
    assert computes_gradients(
        mtls_server,
        root_certificates=pki.ca.cert,
        certificate_chain=pki.client.cert,
        private_key=pki.client.key,
    )
