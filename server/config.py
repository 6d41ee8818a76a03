"""Server configuration: `Config`, built from the flags (`flags.FLAGS`) over the
environment over its defaults, validated once at start-up with errors that name the
flag."""

from __future__ import annotations

import argparse
import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pergrad.server.flags import (
    AUTO_COALESCED_BATCH,
    AUTO_REQUEST_BYTES,
    FLAGS,
    JIT_CHOICES,
    MAX_REQUEST_BYTES,
    METRICS_PORT_OFFSET,
    ConfigError,
    add_arguments,
    given,
)
from pergrad.server.lora_spec import LoraSpec, LoraSpecError, parse_lora
from pergrad.server.optimizer_spec import OptimizerSpec, OptimizerSpecError, parse_optimizer
from pergrad.server.transport.auth import TokenFileError, load_tokens
from pergrad.server.transport.tls import check_files

__all__ = [
    "AUTO_COALESCED_BATCH",
    "AUTO_REQUEST_BYTES",
    "JIT_CHOICES",
    "MAX_REQUEST_BYTES",
    "METRICS_PORT_OFFSET",
    "Config",
    "ConfigError",
    "add_arguments",
    "parse",
]
_PORTS = (0, 65535)


@dataclass(frozen=True)
class Config:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = None  # None: port + METRICS_PORT_OFFSET (0 with port 0)
    open_services_port: int | None = None  # None: health and reflection on `port` too
    models: tuple[str, ...] = ()
    model_dir: Path | None = None
    loss: str | None = None
    max_batch: int = 4096
    max_request_bytes: int | None = None  # None: auto (`request_bytes_bound`)
    max_inflight_examples: int = 16384
    max_inflight_bytes: int = 4 << 30
    chunk_bytes: int = 1 << 20
    workers: int = 8
    max_queued_calls: int = 32
    max_streams: int = 4
    stall_timeout_s: float = 60.0
    batch_window_ms: float = 0.0
    max_coalesced_batch: int | None = None  # None: auto (`coalescing_bound`)
    grace_s: float = 10.0
    jit_compile: str = "auto"
    optimizer: str = "sgd"
    lora: str = ""
    replica_name: str = f"{socket.gethostname()}/{os.getpid()}"
    max_connection_age_s: float = 300.0
    log_level: str = "INFO"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    auth_token_file: Path | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is None:
            derived = self.port + METRICS_PORT_OFFSET if self.port else 0
            object.__setattr__(self, "metrics_port", derived)

    @functools.cached_property
    def optimizer_spec(self) -> OptimizerSpec:
        try:
            return parse_optimizer(self.optimizer)
        except OptimizerSpecError as err:
            raise ConfigError(str(err)) from None

    @functools.cached_property
    def lora_spec(self) -> LoraSpec:
        try:
            return parse_lora(self.lora)
        except LoraSpecError as err:
            raise ConfigError(str(err)) from None

    def coalescing_bound(self, gpu: bool) -> int:
        """--max-coalesced-batch as a number, auto resolved: AUTO_COALESCED_BATCH with a
        GPU, else 0. Measured on a CPU (benchmarks/README.md, 2026-12-03 morning), sharing
        did not pay (0.84-1.08x): bit-identical rows whatever shares a pass take pass sizes
        whose kernels round alike (mnist_mlp's 8 examples in a pass of 47, mnist_cnn's in
        11) and a reduction outside the pass, while passes held 1.9 requests on average."""
        if self.max_coalesced_batch is not None:
            return self.max_coalesced_batch
        return AUTO_COALESCED_BATCH if gpu else 0

    def request_bytes_bound(self, unsplittable_bytes: int) -> int:
        """--max-request-bytes as a number, auto resolved: gRPC's own default (4 MiB) plus
        the most a served model's request holds that cannot be split (a `dot` reference
        row or a step's gradient sum, and one example), within gRPC's bound. A larger
        limit lets a caller make the server copy more bytes before anything can refuse
        them (`benchmarks/attacks.py` row 8); the client splits batches to fit."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return min(AUTO_REQUEST_BYTES + unsplittable_bytes, MAX_REQUEST_BYTES)

    @property
    def max_calls(self) -> int:
        """Calls to the service admitted at once: computing, or waiting for a worker."""
        return self.workers + self.max_queued_calls

    def validate(self) -> Config:
        for flag in FLAGS:
            flag.check_value(getattr(self, flag.attr))
        _validate_ports(self)
        if self.max_streams >= self.workers:
            raise ConfigError(
                f"--max-streams ({self.max_streams}) must be below --workers ({self.workers}),"
                " so that streams cannot hold every worker"
            )
        _ = self.optimizer_spec  # parsed here: a bad --optimizer stops the start
        _ = self.lora_spec  # likewise --lora
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise ConfigError(f"--model-dir {str(self.model_dir)!r} is not a directory")
        _validate_security(self)
        return self


def _validate_ports(config: Config) -> None:
    """Each port in range, and the three apart (metrics' derived from --port's)."""
    assert config.metrics_port is not None  # derived in __post_init__ where unset
    for flag, port in [
        ("--port", config.port),
        ("--metrics-port", config.metrics_port),
        ("--open-services-port", config.open_services_port or 0),
    ]:
        if not _PORTS[0] <= port <= _PORTS[1]:
            why = f" (it defaults to --port + {METRICS_PORT_OFFSET})"
            raise ConfigError(
                f"{flag} must be in [0, 65535], got {port}"
                + (why if flag == "--metrics-port" else "")
            )
    if config.metrics_port == config.port != 0:
        raise ConfigError(f"--metrics-port must differ from --port, both are {config.port}")
    if config.open_services_port and config.open_services_port in (
        config.port,
        config.metrics_port,
    ):
        raise ConfigError(
            f"--open-services-port must differ from --port and --metrics-port, got "
            f"{config.open_services_port} (leave it unset to serve health and reflection "
            "on --port)"
        )


def _validate_security(config: Config) -> None:
    """TLS files that make a usable set, and a token file with at least one token."""
    try:
        check_files(config.tls_cert, config.tls_key, config.tls_client_ca)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if config.auth_token_file is None:
        return
    path = str(config.auth_token_file)
    try:
        load_tokens(config.auth_token_file)
    except OSError as err:
        raise ConfigError(f"--auth-token-file {path!r} cannot be read: {err.strerror}") from None
    except (TokenFileError, UnicodeDecodeError) as err:
        raise ConfigError(f"--auth-token-file {path!r}: {err}") from None


def from_args(args: argparse.Namespace) -> Config:
    return Config(**given(args)).validate()


def parse(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(prog="pergrad serve")
    add_arguments(parser)
    return from_args(parser.parse_args(argv))
