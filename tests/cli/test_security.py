"""`pergrad serve` with mutual TLS and tokens in a process of its own; `info` and `grads`
with the matching flags (and PERGRAD_TOKEN)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pergrad.cli import main
from tests.helpers import spawn_server, stop_server
from tests.pki import Pki, make_pki

PERGRAD = [sys.executable, "-m", "pergrad.cli"]
TOKEN = "cli-token-83d0"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def target(pki: Pki, token_file: Path) -> Iterator[str]:
    process, address = spawn_server(
        *("--model", "mnist_mlp", "--jit-compile", "off"),
        *("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)),
        *("--tls-client-ca", str(pki.ca.cert), "--auth-token-file", str(token_file)),
    )
    yield address
    stop_server(process)


def tls_flags(pki: Pki) -> list[str]:
    """The client's flags for the server's mutual TLS."""
    return [
        *("--tls-ca", str(pki.ca.cert)),
        *("--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)),
    ]


def run(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PERGRAD_TOKEN"}
    if token is not None:
        env["PERGRAD_TOKEN"] = token
    return subprocess.run([*PERGRAD, *args], capture_output=True, text=True, timeout=120, env=env)


def test_info_with_the_ca_certificate_and_token_file_describes_the_model(
    target: str, pki: Pki, token_file: Path
) -> None:
    done = run("info", "--target", target, *tls_flags(pki), "--token-file", str(token_file))
    assert done.returncode == 0, done.stderr
    assert "mnist_mlp  version 1  101,770 parameters" in done.stdout


def test_info_reads_the_token_from_pergrad_token(target: str, pki: Pki) -> None:
    done = run("info", "--target", target, *tls_flags(pki), token=TOKEN)
    assert done.returncode == 0, done.stderr


def test_info_without_a_token_fails_unauthenticated(target: str, pki: Pki) -> None:
    done = run("info", "--target", target, *tls_flags(pki))
    assert done.returncode == 1
    assert "UNAUTHENTICATED: missing bearer token" in done.stderr


def test_info_with_a_wrong_token_fails_unauthenticated(target: str, pki: Pki) -> None:
    done = run("info", "--target", target, *tls_flags(pki), token="not-" + TOKEN)
    assert done.returncode == 1
    assert "UNAUTHENTICATED: invalid bearer token" in done.stderr


def test_info_without_a_client_certificate_fails_unavailable(target: str, pki: Pki) -> None:
    done = run("info", "--target", target, "--tls-ca", str(pki.ca.cert), token=TOKEN)
    assert done.returncode == 1
    assert "UNAVAILABLE" in done.stderr


def test_grads_with_tls_and_token_writes_gradients(
    target: str, pki: Pki, token_file: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.random((6, 784), dtype=np.float32), y=np.arange(6))
    done = run(
        *("grads", "--target", target, "--model", "mnist_mlp", "--quiet"),
        *("--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / "g.npz")),
        *tls_flags(pki),
        *("--token-file", str(token_file)),
    )
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "g.npz")["grad/hidden/kernel"].shape == (6, 784, 128)


def test_unreadable_token_file_is_reported(tmp_path: Path) -> None:
    done = run("info", "--target", "127.0.0.1:1", "--token-file", str(tmp_path / "absent"))
    assert done.returncode == 1
    assert "--token-file" in done.stderr and "cannot be read" in done.stderr


def test_serve_refuses_a_certificate_without_its_key_with_exit_2(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process: the same code path as the command, without importing TensorFlow again.
    assert main(["serve", "--port", "0", "--tls-cert", str(pki.server.cert)]) == 2
    assert "--tls-cert needs --tls-key" in capsys.readouterr().err
