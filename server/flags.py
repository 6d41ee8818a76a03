"""`pergrad serve`'s flags, one row each (FLAGS): the Config field it sets, its PERGRAD_*
variable, how its text is read, its checks, its help. `config` builds and validates a
Config from them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pergrad.wire.chunked_requests import MESSAGE_BYTES

JIT_CHOICES: dict[str, bool | Literal["auto"]] = {"auto": "auto", "on": True, "off": False}
# /metrics listens on the gRPC port + METRICS_PORT_OFFSET unless told otherwise: away from
# Prometheus' own 9090 and from the exporter range 9100-9999 (all allocated; the Prometheus
# docs advise other applications to stay outside it), and two servers on one host with
# their own gRPC ports get their own metrics ports too.
METRICS_PORT_OFFSET = 100
# --max-coalesced-batch auto where TensorFlow sees a GPU, whose passes carry a fixed cost
# (kernel launches) worth sharing; on a CPU a shared pass costs more than a request's own
# (`coalescing_bound`).
AUTO_COALESCED_BATCH = 128
# --max-request-bytes auto: one message's worth (the fixed bound on a message, gRPC's own
# default), plus what a served model's request holds that no client can split
# (`request_bytes_bound`).
AUTO_REQUEST_BYTES = MESSAGE_BYTES
# ServerLimits.max_request_bytes promises at most this (once gRPC's bound on a message).
MAX_REQUEST_BYTES = 2**31 - 1


class ConfigError(ValueError):
    """A setting the server cannot start with; the message names the flag."""


# A check on a flag's value: what it must hold, and what the message says it must be.
Check = tuple[Callable[[Any], bool], str]
_POSITIVE: Check = (lambda v: v > 0, "must be positive")
_NOT_NEGATIVE: Check = (lambda v: v >= 0, "must be >= 0")


@dataclass(frozen=True)
class Flag:
    """One `pergrad serve` flag: the Config field it sets, how its text is read (a
    ValueError: not such a value), its checks, its help; its name and PERGRAD_*
    variable follow from the field's unless given."""

    attr: str
    read: Callable[[str], Any]
    help: str
    checks: tuple[Check, ...] = ()
    name: str = ""
    repeated: bool = False  # given once per value; its variable is comma-separated

    @property
    def flag(self) -> str:
        return self.name or "--" + self.attr.removesuffix("_s").replace("_", "-")

    @property
    def variable(self) -> str:
        return "PERGRAD_" + self.attr.removesuffix("_s").upper()

    def value(self, text: Any) -> Any:
        """The value of the flag's (or its variable's) text, or ConfigError naming both."""
        if self.repeated:
            items = text if isinstance(text, list) else str(text).split(",")
            return tuple(item for item in items if item)
        try:
            return self.read(str(text))
        except ValueError:
            what = "a number or auto" if self.read is _auto_int else "a number"
            raise ConfigError(
                f"{self.flag} (or {self.variable}) must be {what}, got {text!r}"
            ) from None

    def check_value(self, value: Any) -> None:
        if value is None:  # unset or auto
            return
        for holds, requirement in self.checks:
            if not holds(value):
                got = repr(value) if isinstance(value, str) else value
                raise ConfigError(f"{self.flag} {requirement}, got {got}")


def _auto_int(text: str) -> int | None:
    """None for "auto", else a whole number."""
    return None if text.strip().lower() == "auto" else int(text)


def _path(text: str) -> Path | None:
    return Path(text) if text else None


def _upper(text: str) -> str:
    return text.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("host", str, "address to bind"),
    Flag("port", int, "0 picks a free port"),
    Flag(
        "metrics_port",
        int,
        f"HTTP port of the Prometheus /metrics endpoint (default: --port + "
        f"{METRICS_PORT_OFFSET}, 50151); 0 picks a free port",
    ),
    Flag(
        "open_services_port",
        int,
        "serve the health service and reflection (no token needed) on a port of their "
        "own, whose requests gRPC refuses over 4 KiB before Python copies them and whose "
        "connections it holds to half of their places; --port then serves GradientService "
        "alone (default: both on --port); 0 picks a free port",
    ),
    Flag(
        "models",
        str,
        "built-in model name or .keras path (repeatable; PERGRAD_MODELS is a "
        "comma-separated list; default: every built-in model)",
        name="--model",
        repeated=True,
    ),
    Flag("model_dir", _path, ".keras files load only from inside this directory"),
    Flag("loss", str, "Keras loss name for .keras models compiled without one"),
    Flag("max_batch", int, "examples of one request at most", (_POSITIVE,)),
    Flag(
        "max_request_bytes",
        _auto_int,
        "bytes of one request: its message and the bytes it declares in chunks; a larger "
        "one is refused from its first message, before any chunk is read (auto, the "
        f"default: {AUTO_REQUEST_BYTES >> 20} MiB plus the most a served model's request "
        "holds that cannot be split: its variables in float32 and one example; the client "
        "splits batches to fit). Whatever it is, no message may exceed "
        f"{MESSAGE_BYTES >> 20} MiB: gRPC refuses a larger one before Python copies it",
        (
            _POSITIVE,
            (
                lambda v: v <= MAX_REQUEST_BYTES,
                f"must be at most {MAX_REQUEST_BYTES}",
            ),
        ),
    ),
    Flag(
        "max_inflight_examples",
        int,
        "examples being computed at once; more is refused with RESOURCE_EXHAUSTED",
        (_POSITIVE,),
    ),
    Flag(
        "max_inflight_bytes",
        int,
        "bytes calls hold at once (requests from their arrival, results while "
        "produced), a caller with calls held at most half; more is RESOURCE_EXHAUSTED",
        (_POSITIVE,),
    ),
    Flag(
        "chunk_bytes", int, "bytes of a result's or weights' tensor chunk on the wire", (_POSITIVE,)
    ),
    Flag(
        "workers",
        int,
        "calls computing at once (each call admitted also has a thread of its own)",
        (_POSITIVE,),
    ),
    Flag(
        "max_queued_calls",
        int,
        "calls waiting for a worker; more are refused with RESOURCE_EXHAUSTED",
        (_POSITIVE,),
    ),
    Flag(
        "max_streams",
        int,
        "request streams (StreamPerExampleGradients, SetWeights) open at once; below --workers",
        (_POSITIVE,),
    ),
    Flag(
        "stall_timeout_s",
        float,
        "seconds a call may wait on its client (next request, reading responses) before "
        "it is cancelled",
        (_POSITIVE,),
    ),
    Flag(
        "batch_window_ms",
        float,
        "milliseconds a shared pass waits for more requests before it starts (0: it takes "
        "those already waiting, so a lone request waits for nothing)",
        ((lambda v: 0 <= v <= 1000, "must be in [0, 1000]"),),
    ),
    Flag(
        "max_coalesced_batch",
        _auto_int,
        "bound on the examples of one shared pass: passes hold the largest power of two "
        "within it and the engine's slice, and requests smaller than that pass size share "
        f"passes (0: no coalescing; auto, the default: {AUTO_COALESCED_BATCH} where "
        "TensorFlow sees a GPU, 0 on a CPU)",
        ((lambda v: v >= 0, "must be >= 0 (0 turns coalescing off)"),),
    ),
    Flag("grace_s", float, "seconds to drain in-flight calls on SIGTERM", (_NOT_NEGATIVE,)),
    Flag(
        "jit_compile",
        str,
        "XLA for the model's pass: auto (measured per model), on or off (the noise "
        "generator is compiled whatever this says: its few fixed shapes, the same bits)",
        ((lambda v: v in JIT_CHOICES, f"must be one of {sorted(JIT_CHOICES)}"),),
    ),
    Flag(
        "optimizer",
        str,
        "the Keras optimizer ApplyStep uses, its state held per model: name[:key=value,"
        "...], e.g. sgd, sgd:momentum=0.9, adam:beta_2=0.99 (the learning rate is each step's)",
    ),
    Flag(
        "lora",
        str,
        "enable LoRA on the served .keras models at load and train only its factors (and "
        "the layers named in train): rank=R[,alpha=A][,targets=L1+L2][,train=L3+L4]; "
        "targets default to each keras-hub backbone's own, train to the layers outside the "
        "backbones (a classifier's head); default: off, every weight trains",
    ),
    Flag("replica_name", str, "names this server in results (default: hostname/pid)"),
    Flag(
        "max_connection_age_s",
        float,
        "seconds before a client connection is closed so clients re-resolve replicas",
        (_POSITIVE,),
    ),
    Flag("log_level", _upper, "DEBUG, INFO, WARNING or ERROR"),
    Flag(
        "tls_cert",
        _path,
        "PEM certificate (chain) of the server; with --tls-key the port speaks only TLS",
    ),
    Flag("tls_key", _path, "PEM private key"),
    Flag(
        "tls_client_ca",
        _path,
        "PEM CA certificate(s): require client certificates they signed (mutual TLS)",
    ),
    Flag(
        "auth_token_file",
        _path,
        "bearer tokens, one a line ('TOKEN:ro' is read-only); calls without one are "
        "refused, except health and reflection",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags (`FLAGS`); one not given takes its PERGRAD_* variable's value, then
    Config's default (`from_args`)."""
    for flag in FLAGS:
        parser.add_argument(
            flag.flag,
            dest=flag.attr,
            action="append" if flag.repeated else "store",
            metavar=flag.variable.removeprefix("PERGRAD_"),
            help=f"{flag.help} [{flag.variable}]",
        )


def given(args: argparse.Namespace) -> dict[str, Any]:
    """Each flag given, else set by its variable: its value, by its Config field's name."""
    values = {}
    for flag in FLAGS:
        text = getattr(args, flag.attr)
        text = os.environ.get(flag.variable) if text is None else text
        if text is not None:
            values[flag.attr] = flag.value(text)
    return values


def markdown() -> str:
    """The flags as docs/operations.md shows them."""
    lines = ["| flag | variable | what it sets |", "| --- | --- | --- |"]
    lines += [f"| `{f.flag}` | `{f.variable}` | {f.help} |" for f in FLAGS]
    return "\n".join(lines) + "\n"
