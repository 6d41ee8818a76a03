"""The container's health check and the TLS deployment's exec probe, against real servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pergrad.server.healthcheck import main
from pergrad.server.main import RunningServer, start
from tests.helpers import loopback_config
from tests.pki import Pem, Pki, make_pki


def test_exits_zero_for_a_serving_server(server: RunningServer) -> None:
    assert main(["--target", f"127.0.0.1:{server.port}"]) == 0


def test_exits_one_for_a_draining_server(fresh_server: RunningServer) -> None:
    fresh_server.health.stop_serving()
    assert main(["--target", f"127.0.0.1:{fresh_server.port}"]) == 1


def test_exits_one_when_nothing_listens() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["--target", f"127.0.0.1:{port}", "--timeout", "1"]) == 1


def test_module_checks_the_port_from_the_environment(server: RunningServer) -> None:
    """As the Dockerfile's HEALTHCHECK runs it: no flags, PERGRAD_PORT set."""
    run = subprocess.run(
        [sys.executable, "-m", "pergrad.server.healthcheck"],
        env={**os.environ, "PERGRAD_PORT": str(server.port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "SERVING"


def test_module_checks_the_open_services_port_where_they_have_one() -> None:
    """With PERGRAD_OPEN_SERVICES_PORT set, as a deployment giving health a port of its
    own sets it for the server: the service's port answers no health check."""
    running = start(loopback_config("mnist_mlp", open_services_port=0))
    try:
        assert _probe(PORT=running.port).returncode == 1
        run = _probe(PORT=running.port, OPEN_SERVICES_PORT=running.open_port)
        assert run.returncode == 0, run.stderr
    finally:
        running.stop(0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, model_dir: Path) -> Iterator[RunningServer]:
    running = start(
        loopback_config(
            "mnist_mlp", model_dir=model_dir, tls_cert=pki.server.cert, tls_key=pki.server.key
        )
    )
    yield running
    running.stop(0)


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, model_dir: Path) -> Iterator[tuple[RunningServer, Pem]]:
    """Mutual TLS, with a server certificate that may also authenticate as a client."""
    pair = pki.ca.issue("dual", server=True, client=True)
    running = start(
        loopback_config(
            "mnist_mlp",
            model_dir=model_dir,
            tls_cert=pair.cert,
            tls_key=pair.key,
            tls_client_ca=pki.ca.cert,
        )
    )
    yield running, pair
    running.stop(0)


def _probe(**env: object) -> subprocess.CompletedProcess:
    """The module as the Dockerfile and the TLS overlay's exec probes run it: no flags."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PERGRAD_")}
    return subprocess.run(
        [sys.executable, "-m", "pergrad.server.healthcheck"],
        env={**clean, **{f"PERGRAD_{k}": str(v) for k, v in env.items()}},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_probe_speaks_tls_with_the_servers_own_variables(tls_server, pki: Pki) -> None:
    run = _probe(
        PORT=tls_server.port, TLS_CERT=pki.server.cert, TLS_KEY=pki.server.key, TLS_CA=pki.ca.cert
    )
    assert (run.returncode, run.stderr.strip()) == (0, "SERVING")


def test_plaintext_probe_of_a_tls_port_fails(tls_server) -> None:
    assert _probe(PORT=tls_server.port).returncode == 1


def test_probe_refuses_a_server_its_ca_did_not_sign(tls_server, pki: Pki) -> None:
    run = _probe(
        PORT=tls_server.port,
        TLS_CERT=pki.server.cert,
        TLS_KEY=pki.server.key,
        TLS_CA=pki.other_ca.cert,
    )
    assert run.returncode == 1


def test_probe_checks_the_configured_server_name(tls_server, pki: Pki) -> None:
    common = {"PORT": tls_server.port, "TLS_CERT": pki.server.cert, "TLS_CA": pki.ca.cert}
    assert _probe(**common, TLS_SERVER_NAME="localhost").returncode == 0
    assert _probe(**common, TLS_SERVER_NAME="elsewhere.example").returncode == 1


def test_probe_of_mutual_tls_presents_the_servers_own_pair(mtls_server, pki: Pki) -> None:
    running, pair = mtls_server
    run = _probe(
        PORT=running.port,
        TLS_CERT=pair.cert,
        TLS_KEY=pair.key,
        TLS_CA=pki.ca.cert,
        TLS_CLIENT_CA=pki.ca.cert,
    )
    assert (run.returncode, run.stderr.strip()) == (0, "SERVING")


def test_probe_of_mutual_tls_without_a_client_pair_fails(mtls_server, pki: Pki) -> None:
    running, pair = mtls_server
    run = _probe(PORT=running.port, TLS_CERT=pair.cert, TLS_CA=pki.ca.cert)
    assert run.returncode == 1
