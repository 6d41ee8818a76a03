"""Configuration: flags over PERGRAD_* environment over defaults, refused when invalid."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pergrad.server.config import (
    AUTO_COALESCED_BATCH,
    AUTO_REQUEST_BYTES,
    MAX_REQUEST_BYTES,
    METRICS_PORT_OFFSET,
    Config,
    ConfigError,
    parse,
)
from tests.pki import Pki, make_pki


def test_defaults_serve_every_builtin_on_port_50051(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERGRAD_MODELS", raising=False)
    config = parse([])
    assert config.port == 50051 and config.models == () and config.max_batch == 4096


def test_environment_sets_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PERGRAD_PORT", "6000")
    monkeypatch.setenv("PERGRAD_MODELS", "mnist_mlp,a.keras")
    monkeypatch.setenv("PERGRAD_MODEL_DIR", str(tmp_path))
    config = parse([])
    assert config.port == 6000
    assert config.models == ("mnist_mlp", "a.keras")
    assert config.model_dir == tmp_path


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_PORT", "6000")
    monkeypatch.setenv("PERGRAD_MODELS", "mnist_mlp")
    config = parse(["--port", "7000", "--model", "mnist_cnn"])
    assert config.port == 7000 and config.models == ("mnist_cnn",)


def test_metrics_port_defaults_to_the_grpc_port_plus_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PERGRAD_METRICS_PORT", raising=False)
    monkeypatch.delenv("PERGRAD_PORT", raising=False)
    assert parse([]).metrics_port == 50051 + METRICS_PORT_OFFSET
    assert parse(["--port", "6000"]).metrics_port == 6000 + METRICS_PORT_OFFSET
    assert parse(["--port", "0"]).metrics_port == 0  # a free port, like the gRPC one


def test_default_metrics_port_is_neither_prometheus_nor_an_exporter_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PERGRAD_METRICS_PORT", raising=False)
    monkeypatch.delenv("PERGRAD_PORT", raising=False)
    assert not 9090 <= parse([]).metrics_port <= 9999


def test_two_servers_on_one_host_get_distinct_metrics_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PERGRAD_METRICS_PORT", raising=False)
    first, second = parse(["--port", "50051"]), parse(["--port", "50052"])
    ports = {first.port, first.metrics_port, second.port, second.metrics_port}
    assert len(ports) == 4


def test_metrics_port_reads_its_environment_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_METRICS_PORT", "9400")
    assert parse([]).metrics_port == 9400
    assert parse(["--metrics-port", "0"]).metrics_port == 0


def test_open_services_share_the_port_unless_given_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse([]).open_services_port is None
    monkeypatch.setenv("PERGRAD_OPEN_SERVICES_PORT", "50251")
    assert parse([]).open_services_port == 50251
    assert parse(["--open-services-port", "0"]).open_services_port == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in"),
        (["--max-batch", "0"], "--max-batch must be positive"),
        (["--workers", "-1"], "--workers must be positive"),
        (["--grace", "-2"], "--grace must be >= 0"),
        (["--metrics-port", "70000"], "--metrics-port must be in"),
        (["--port", "7000", "--metrics-port", "7000"], "--metrics-port must differ from --port"),
        (["--port", "65500"], "--metrics-port must be in .* defaults to --port"),
        (["--open-services-port", "70000"], "--open-services-port must be in"),
        (["--open-services-port", "50051"], "--open-services-port must differ from --port"),
        (["--open-services-port", "50151"], "--open-services-port must differ from --port"),
        (["--model-dir", "/nonexistent/models"], "is not a directory"),
        (["--batch-window-ms", "-1"], "--batch-window-ms must be in"),
        (["--batch-window-ms", "nan"], "--batch-window-ms must be in"),
        (["--max-coalesced-batch", "-4"], "--max-coalesced-batch must be >= 0"),
        (["--max-coalesced-batch", "many"], "--max-coalesced-batch .* must be a number"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be positive"),
        (["--max-request-bytes", "4MiB"], "--max-request-bytes .* must be a number or auto"),
        (["--max-request-bytes", str(2**31)], "--max-request-bytes must be at most 2147483647"),
        (["--optimizer", "sgd:momentum"], "--optimizer 'sgd:momentum': settings are key=value"),
        (["--optimizer", "adam:beta_1=high"], "'high' is not a number, true or false"),
        (["--optimizer", ":momentum=0.9"], "begins with an optimizer's name"),
        (["--lora", "4"], "--lora '4': settings are key=value"),
        (["--lora", "rank=0"], "rank must be positive, got '0'"),
        (["--lora", "rank=2.5"], "rank must be a number, got '2.5'"),
        (["--lora", "rank=2,alpha=big"], "alpha must be a number, got 'big'"),
        (["--lora", "alpha=4"], "rank must be a number, got ''"),
    ],
)
def test_invalid_settings_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_coalescing_settings_read_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_BATCH_WINDOW_MS", "5.5")
    monkeypatch.setenv("PERGRAD_MAX_COALESCED_BATCH", "0")
    config = parse([])
    assert (config.batch_window_ms, config.max_coalesced_batch) == (5.5, 0)


@pytest.mark.parametrize(
    "argv", [[], ["--max-coalesced-batch", "auto"], ["--max-coalesced-batch", " AUTO "]]
)
def test_coalescing_is_auto_by_default_or_when_asked(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERGRAD_MAX_COALESCED_BATCH", raising=False)
    assert parse(argv).max_coalesced_batch is None


def test_coalescing_reads_auto_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_MAX_COALESCED_BATCH", "auto")
    assert parse([]).max_coalesced_batch is None


@pytest.mark.parametrize("value", ["1.5", "", "many"])
def test_a_coalescing_bound_neither_a_number_nor_auto_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--max-coalesced-batch .* must be a number or auto"):
        parse(["--max-coalesced-batch", value])


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_coalescing_shares_passes_only_with_a_gpu(gpu: bool) -> None:
    assert Config().coalescing_bound(gpu=gpu) == (AUTO_COALESCED_BATCH if gpu else 0)


@pytest.mark.parametrize("gpu", [False, True])
def test_a_coalescing_bound_given_is_kept_with_or_without_a_gpu(gpu: bool) -> None:
    assert parse(["--max-coalesced-batch", "32"]).coalescing_bound(gpu=gpu) == 32


@pytest.mark.parametrize("argv", [[], ["--max-request-bytes", "auto"]])
def test_the_message_limit_is_auto_by_default_or_when_asked(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERGRAD_MAX_REQUEST_BYTES", raising=False)
    assert parse(argv).max_request_bytes is None


def test_the_auto_message_limit_makes_room_for_the_largest_models_variables() -> None:
    assert Config().request_bytes_bound(407_080) == AUTO_REQUEST_BYTES + 407_080


def test_the_auto_message_limit_stays_within_grpcs_bound() -> None:
    assert Config().request_bytes_bound(3 << 30) == MAX_REQUEST_BYTES


def test_a_message_limit_given_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_MAX_REQUEST_BYTES", "65536")
    assert parse([]).request_bytes_bound(407_080) == 65536


def test_non_numeric_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_MAX_BATCH", "lots")
    with pytest.raises(
        ConfigError, match=r"--max-batch \(or PERGRAD_MAX_BATCH\) must be a number, got .lots."
    ):
        parse([])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_and_token_flags_read_their_environment(
    monkeypatch: pytest.MonkeyPatch, pki: Pki, tmp_path: Path
) -> None:
    (tmp_path / "tokens").write_text("secret\n")
    monkeypatch.setenv("PERGRAD_TLS_CERT", str(pki.server.cert))
    monkeypatch.setenv("PERGRAD_TLS_KEY", str(pki.server.key))
    monkeypatch.setenv("PERGRAD_TLS_CLIENT_CA", str(pki.ca.cert))
    monkeypatch.setenv("PERGRAD_AUTH_TOKEN_FILE", str(tmp_path / "tokens"))
    config = parse([])
    assert (config.tls_cert, config.tls_key) == (pki.server.cert, pki.server.key)
    assert config.tls_client_ca == pki.ca.cert
    assert config.auth_token_file == tmp_path / "tokens"


def test_security_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA", "AUTH_TOKEN_FILE"):
        monkeypatch.delenv(f"PERGRAD_{name}", raising=False)
    config = parse([])
    assert config.tls_cert is config.tls_key is config.tls_client_ca is None
    assert config.auth_token_file is None


# argv from the test PKI and a scratch directory -> the error it must raise
_INVALID_SECURITY: list[tuple[Callable[[Pki, Path], list[str]], str]] = [
    (lambda p, _: ["--tls-cert", str(p.server.cert)], "--tls-cert needs --tls-key"),
    (lambda p, _: ["--tls-key", str(p.server.key)], "--tls-key needs --tls-cert"),
    (
        lambda p, _: ["--tls-client-ca", str(p.ca.cert)],
        "--tls-client-ca needs --tls-cert and --tls-key",
    ),
    (
        lambda p, d: ["--tls-cert", str(d / "absent.pem"), "--tls-key", str(p.server.key)],
        "--tls-cert .*absent.pem' cannot be read",
    ),
    (
        lambda p, d: ["--tls-cert", str(p.server.cert), "--tls-key", str(d / "absent.pem")],
        "--tls-key .*absent.pem' cannot be read",
    ),
    (
        lambda p, _: ["--tls-cert", str(p.server.cert), "--tls-key", str(p.other_server.key)],
        "are not a certificate and its unencrypted key",
    ),
    (
        lambda p, d: ["--tls-cert", str(p.server.cert), "--tls-key", str(d / "plain.txt")],
        "--tls-key .*plain.txt' is not a PEM file",
    ),
    (
        lambda p, d: [
            *("--tls-cert", str(p.server.cert), "--tls-key", str(p.server.key)),
            *("--tls-client-ca", str(d / "absent.pem")),
        ],
        "--tls-client-ca .*absent.pem' cannot be read",
    ),
    (
        lambda p, _: [
            *("--tls-cert", str(p.server.cert), "--tls-key", str(p.server.key)),
            *("--tls-client-ca", str(p.client.key)),
        ],
        "--tls-client-ca .* holds no usable certificate",
    ),
    (
        lambda _, d: ["--auth-token-file", str(d / "absent")],
        "--auth-token-file .*absent' cannot be read",
    ),
    (
        lambda _, d: ["--auth-token-file", str(d / "plain.txt")],
        "--auth-token-file .*plain.txt': line 1: a token is one word",
    ),
    (
        lambda _, d: ["--auth-token-file", str(d / "empty")],
        "--auth-token-file .*empty': holds no tokens",
    ),
]


@pytest.mark.parametrize(("argv", "message"), _INVALID_SECURITY)
def test_unusable_security_settings_are_refused_naming_the_flag(
    argv: Callable[[Pki, Path], list[str]], message: str, pki: Pki, tmp_path: Path
) -> None:
    (tmp_path / "plain.txt").write_text("not a certificate\n")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match=message):
        parse(argv(pki, tmp_path))


def test_lora_reads_rank_alpha_targets_and_what_else_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PERGRAD_LORA", "rank=4,alpha=8,targets=query+value,train=head")
    spec = parse([]).lora_spec
    assert (spec.rank, spec.alpha, spec.targets, spec.train) == (
        4,
        8.0,
        ("query", "value"),
        ("head",),
    )
    assert not parse(["--lora", ""]).lora_spec
