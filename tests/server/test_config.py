"""Configuration: flags over PERGRAD_* environment over defaults, refused when invalid."""

from __future__ import annotations

from pathlib import Path

import pytest

from pergrad.server.config import ConfigError, parse


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


def test_metrics_port_defaults_to_9090_and_reads_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PERGRAD_METRICS_PORT", raising=False)
    assert parse([]).metrics_port == 9090
    monkeypatch.setenv("PERGRAD_METRICS_PORT", "9100")
    assert parse([]).metrics_port == 9100
    assert parse(["--metrics-port", "0"]).metrics_port == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in"),
        (["--max-batch", "0"], "--max-batch must be positive"),
        (["--workers", "-1"], "--workers must be positive"),
        (["--grace", "-2"], "--grace must be >= 0"),
        (["--metrics-port", "70000"], "--metrics-port must be in"),
        (["--port", "7000", "--metrics-port", "7000"], "--metrics-port must differ from --port"),
        (["--model-dir", "/nonexistent/models"], "is not a directory"),
    ],
)
def test_invalid_settings_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_non_numeric_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERGRAD_MAX_BATCH", "lots")
    with pytest.raises(
        ConfigError, match=r"--max-batch \(or PERGRAD_MAX_BATCH\) must be a number, got .lots."
    ):
        parse([])
