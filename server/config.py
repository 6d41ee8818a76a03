"""Server configuration: flags, each with a PERGRAD_* environment default, validated once."""

from __future__ import annotations

import argparse
import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pergrad.server.auth import TokenFileError, load_tokens
from pergrad.server.lora_spec import LoraSpec, LoraSpecError, parse_lora
from pergrad.server.tls import check_files

JIT_CHOICES = {"auto": "auto", "on": True, "off": False}
# /metrics listens on the gRPC port + METRICS_PORT_OFFSET unless told otherwise: away from
# Prometheus' own 9090 and from the exporter range 9100-9999 (all allocated; the Prometheus
# docs advise other applications to stay outside it), and two servers on one host with
# their own gRPC ports get their own metrics ports too.
METRICS_PORT_OFFSET = 100
# --max-coalesced-batch auto where TensorFlow sees a GPU, whose passes carry a fixed cost
# (kernel launches) worth sharing; on a CPU a shared pass costs more than a request's own
# (`coalescing_bound`).
AUTO_COALESCED_BATCH = 128
# --max-request-bytes auto: gRPC's own default message limit, plus what a served model's
# request holds that no client can split (`request_bytes_bound`).
AUTO_REQUEST_BYTES = 4 << 20
# gRPC takes a message limit as a C int.
MAX_REQUEST_BYTES = 2**31 - 1


class ConfigError(ValueError):
    """A setting the server cannot start with; the message names the flag."""


@dataclass(frozen=True)
class OptimizerSpec:
    """--optimizer: a Keras optimizer's name and settings, "name[:key=value,...]"; whether
    Keras has them is checked before any model loads (`pergrad.server.training`)."""

    text: str
    name: str
    options: tuple[tuple[str, float | int | bool], ...]


def parse_optimizer(text: str) -> OptimizerSpec:
    name, _, rest = text.partition(":")
    options = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier():
            raise ConfigError(
                f"--optimizer {text!r}: settings are key=value, comma-separated "
                "(e.g. sgd:momentum=0.9,nesterov=true)"
            )
        options.append((key.strip(), _setting(text, value.strip())))
    if not name.strip().isidentifier():
        raise ConfigError(f"--optimizer {text!r}: begins with an optimizer's name, e.g. sgd")
    return OptimizerSpec(text, name.strip().lower(), tuple(options))


def _setting(text: str, value: str) -> float | int | bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ConfigError(f"--optimizer {text!r}: {value!r} is not a number, true or false")


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
        return parse_optimizer(self.optimizer)

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
        for flag, port in [
            ("--port", self.port),
            ("--metrics-port", self.metrics_port),
            ("--open-services-port", self.open_services_port or 0),
        ]:
            if not 0 <= port <= 65535:
                why = f" (it defaults to --port + {METRICS_PORT_OFFSET})"
                raise ConfigError(
                    f"{flag} must be in [0, 65535], got {port}"
                    + (why if flag == "--metrics-port" else "")
                )
        if self.metrics_port == self.port != 0:
            raise ConfigError(f"--metrics-port must differ from --port, both are {self.port}")
        if self.open_services_port and self.open_services_port in (self.port, self.metrics_port):
            raise ConfigError(
                f"--open-services-port must differ from --port and --metrics-port, got "
                f"{self.open_services_port} (leave it unset to serve health and reflection "
                "on --port)"
            )
        for flag, value in [
            ("--max-batch", self.max_batch),
            ("--max-request-bytes", self.max_request_bytes),
            ("--max-inflight-examples", self.max_inflight_examples),
            ("--max-inflight-bytes", self.max_inflight_bytes),
            ("--chunk-bytes", self.chunk_bytes),
            ("--workers", self.workers),
            ("--max-queued-calls", self.max_queued_calls),
            ("--max-streams", self.max_streams),
        ]:
            if value is not None and value < 1:  # None: auto
                raise ConfigError(f"{flag} must be positive, got {value}")
        if (self.max_request_bytes or 0) > MAX_REQUEST_BYTES:
            raise ConfigError(
                f"--max-request-bytes must be at most {MAX_REQUEST_BYTES} (gRPC's bound), "
                f"got {self.max_request_bytes}"
            )
        if self.jit_compile not in JIT_CHOICES:
            raise ConfigError(
                f"--jit-compile must be one of {sorted(JIT_CHOICES)}, got {self.jit_compile!r}"
            )
        if not self.max_connection_age_s > 0:
            raise ConfigError(
                f"--max-connection-age must be positive, got {self.max_connection_age_s}"
            )
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"--stall-timeout must be positive, got {self.stall_timeout_s}")
        if self.max_streams >= self.workers:
            raise ConfigError(
                f"--max-streams ({self.max_streams}) must be below --workers ({self.workers}),"
                " so that streams cannot hold every worker"
            )
        if not 0 <= self.batch_window_ms <= 1000:
            raise ConfigError(f"--batch-window-ms must be in [0, 1000], got {self.batch_window_ms}")
        if self.max_coalesced_batch is not None and self.max_coalesced_batch < 0:
            raise ConfigError(
                f"--max-coalesced-batch must be >= 0 (0 turns coalescing off), "
                f"got {self.max_coalesced_batch}"
            )
        _ = self.optimizer_spec  # parsed here: a bad --optimizer stops the start
        _ = self.lora_spec  # likewise --lora
        if self.grace_s < 0:
            raise ConfigError(f"--grace must be >= 0, got {self.grace_s}")
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise ConfigError(f"--model-dir {str(self.model_dir)!r} is not a directory")
        _validate_security(self)
        return self


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


def _env(name: str, default: object) -> object:
    return os.environ.get(f"PERGRAD_{name}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to its PERGRAD_<NAME> environment variable."""
    d = Config()
    parser.add_argument("--host", default=_env("HOST", d.host), help="address to bind")
    parser.add_argument("--port", default=_env("PORT", d.port), help="0 picks a free port")
    parser.add_argument(
        "--metrics-port",
        default=_env("METRICS_PORT", None),
        help=f"HTTP port of the Prometheus /metrics endpoint (default: --port + "
        f"{METRICS_PORT_OFFSET}, 50151); 0 picks a free port",
    )
    parser.add_argument(
        "--open-services-port",
        default=_env("OPEN_SERVICES_PORT", None),
        help="serve the health service and reflection (no token needed) on a port of their "
        "own, whose requests gRPC refuses over 4 KiB before Python copies them; --port then "
        "serves GradientService alone (default: both on --port); 0 picks a free port",
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        help="built-in model name or .keras path (repeatable; PERGRAD_MODELS is a "
        "comma-separated list; default: every built-in model)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=_env("MODEL_DIR", None),
        help=".keras files load only from inside this directory",
    )
    parser.add_argument(
        "--loss",
        default=_env("LOSS", None),
        help="Keras loss name for .keras models compiled without one",
    )
    parser.add_argument("--max-batch", default=_env("MAX_BATCH", d.max_batch))
    parser.add_argument(
        "--max-request-bytes",
        default=_env("MAX_REQUEST_BYTES", "auto"),
        help="bytes of one request message; gRPC refuses a larger one before Python copies "
        f"it (auto, the default: {AUTO_REQUEST_BYTES >> 20} MiB plus the most a served "
        "model's request holds that cannot be split: its variables in float32 and one "
        "example; the client splits batches to fit)",
    )
    parser.add_argument(
        "--max-inflight-examples",
        default=_env("MAX_INFLIGHT_EXAMPLES", d.max_inflight_examples),
        help="examples being computed at once; more is refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-inflight-bytes",
        default=_env("MAX_INFLIGHT_BYTES", d.max_inflight_bytes),
        help="bytes calls hold at once (requests from their arrival, results while "
        "produced), a caller with calls held at most half; more is RESOURCE_EXHAUSTED",
    )
    parser.add_argument("--chunk-bytes", default=_env("CHUNK_BYTES", d.chunk_bytes))
    parser.add_argument(
        "--workers",
        default=_env("WORKERS", d.workers),
        help="calls computing at once (each call admitted also has a thread of its own)",
    )
    parser.add_argument(
        "--max-queued-calls",
        default=_env("MAX_QUEUED_CALLS", d.max_queued_calls),
        help="calls waiting for a worker; more are refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-streams",
        default=_env("MAX_STREAMS", d.max_streams),
        help="request streams (StreamPerExampleGradients, SetWeights) open at once; "
        "below --workers",
    )
    parser.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        default=_env("STALL_TIMEOUT", d.stall_timeout_s),
        help="seconds a call may wait on its client (next request, reading responses) "
        "before it is cancelled",
    )
    parser.add_argument(
        "--batch-window-ms",
        default=_env("BATCH_WINDOW_MS", d.batch_window_ms),
        help="milliseconds a shared pass waits for more requests before it starts (0: it "
        "takes those already waiting, so a lone request waits for nothing)",
    )
    parser.add_argument(
        "--max-coalesced-batch",
        default=_env("MAX_COALESCED_BATCH", "auto"),
        help="bound on the examples of one shared pass: passes hold the largest power of two "
        "within it and the engine's slice, and requests smaller than that pass size share passes "
        f"(0: no coalescing; auto, the default: {AUTO_COALESCED_BATCH} where TensorFlow sees a "
        "GPU, 0 on a CPU)",
    )
    parser.add_argument(
        "--grace",
        dest="grace_s",
        default=_env("GRACE", d.grace_s),
        help="seconds to drain in-flight calls on SIGTERM",
    )
    parser.add_argument(
        "--jit-compile",
        default=_env("JIT_COMPILE", d.jit_compile),
        help="XLA for the model's pass: auto (measured per model), on or off (the noise "
        "generator is compiled whatever this says: its few fixed shapes, the same bits)",
    )
    parser.add_argument(
        "--optimizer",
        default=_env("OPTIMIZER", d.optimizer),
        help="the Keras optimizer ApplyStep uses, its state held per model: name[:key=value,"
        "...], e.g. sgd, sgd:momentum=0.9, adam:beta_2=0.99 (the learning rate is each step's)",
    )
    parser.add_argument(
        "--lora",
        default=_env("LORA", d.lora),
        help="enable LoRA on the served .keras models at load and train only its factors "
        "(and the layers named in train): rank=R[,alpha=A][,targets=L1+L2][,train=L3+L4]; "
        "targets default to each keras-hub backbone's own, train to the layers outside the "
        "backbones (a classifier's head); default: off, every weight trains",
    )
    parser.add_argument(
        "--replica-name",
        default=_env("REPLICA_NAME", d.replica_name),
        help="names this server in results (default: hostname/pid)",
    )
    parser.add_argument(
        "--max-connection-age",
        dest="max_connection_age_s",
        default=_env("MAX_CONNECTION_AGE", d.max_connection_age_s),
        help="seconds before a client connection is closed so clients re-resolve replicas",
    )
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", d.log_level))
    _add_security_arguments(parser)


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert",
        default=_env("TLS_CERT", None),
        help="PEM certificate (chain) of the server; with --tls-key the port speaks only TLS",
    )
    parser.add_argument("--tls-key", default=_env("TLS_KEY", None), help="PEM private key")
    parser.add_argument(
        "--tls-client-ca",
        default=_env("TLS_CLIENT_CA", None),
        help="PEM CA certificate(s): require client certificates they signed (mutual TLS)",
    )
    parser.add_argument(
        "--auth-token-file",
        default=_env("AUTH_TOKEN_FILE", None),
        help="bearer tokens, one a line ('TOKEN:ro' is read-only); calls without one are "
        "refused, except health and reflection",
    )


def _number(args: argparse.Namespace, attr: str, kind: type) -> int | float:
    value = getattr(args, attr)
    try:
        return kind(value)
    except ValueError:
        flag, env = _names(attr)
        raise ConfigError(f"{flag} (or {env}) must be a number, got {value!r}") from None


def _names(attr: str) -> tuple[str, str]:
    """The flag and the environment variable that set `attr`."""
    name = attr.removesuffix("_s")
    return "--" + name.replace("_", "-"), "PERGRAD_" + name.upper()


def _auto_or_number(args: argparse.Namespace, attr: str) -> int | None:
    """None for "auto", else the flag's whole number."""
    value = getattr(args, attr)
    if str(value).strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        flag, env = _names(attr)
        raise ConfigError(f"{flag} (or {env}) must be a number or auto, got {value!r}") from None


def from_args(args: argparse.Namespace) -> Config:
    env_models = [m for m in str(_env("MODELS", "")).split(",") if m]
    return Config(
        host=args.host,
        port=_number(args, "port", int),
        metrics_port=None if args.metrics_port is None else _number(args, "metrics_port", int),
        open_services_port=(
            None if args.open_services_port is None else _number(args, "open_services_port", int)
        ),
        models=tuple(args.models or env_models),
        model_dir=Path(args.model_dir) if args.model_dir else None,
        loss=args.loss,
        max_batch=_number(args, "max_batch", int),
        max_request_bytes=_auto_or_number(args, "max_request_bytes"),
        max_inflight_examples=_number(args, "max_inflight_examples", int),
        max_inflight_bytes=_number(args, "max_inflight_bytes", int),
        chunk_bytes=_number(args, "chunk_bytes", int),
        workers=_number(args, "workers", int),
        max_queued_calls=_number(args, "max_queued_calls", int),
        max_streams=_number(args, "max_streams", int),
        stall_timeout_s=_number(args, "stall_timeout_s", float),
        batch_window_ms=_number(args, "batch_window_ms", float),
        max_coalesced_batch=_auto_or_number(args, "max_coalesced_batch"),
        grace_s=_number(args, "grace_s", float),
        jit_compile=str(args.jit_compile),
        optimizer=str(args.optimizer),
        lora=str(args.lora),
        replica_name=str(args.replica_name),
        max_connection_age_s=_number(args, "max_connection_age_s", float),
        log_level=str(args.log_level).upper(),
        tls_cert=_path(args.tls_cert),
        tls_key=_path(args.tls_key),
        tls_client_ca=_path(args.tls_client_ca),
        auth_token_file=_path(args.auth_token_file),
    ).validate()


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def parse(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(prog="pergrad serve")
    add_arguments(parser)
    return from_args(parser.parse_args(argv))
