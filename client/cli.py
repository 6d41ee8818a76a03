"""The `pergrad` command: `info`, `grads` (client side) and `serve` (needs pergrad[server])."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pergrad.client import GradientClient, GradientResult, ModelInfo, PergradError

DEFAULT_TARGET = os.environ.get("PERGRAD_TARGET", "localhost:50051")


def _describe(info: ModelInfo) -> str:
    lines = [
        f"{info.name}  version {info.model_version}  {info.num_parameters:,} parameters",
        f"  input   {info.input.dtype.name} {list(info.input.shape)}",
        f"  labels  {info.labels.dtype.name} {list(info.labels.shape)}"
        + (f"  classes {info.num_classes}" if info.num_classes else ""),
        f"  loss    {info.loss}",
    ]
    lines += [f"  var     {v.name}  {v.dtype.name} {list(v.shape)}" for v in info.variables]
    return "\n".join(lines)


# GradientClient keyword: the attribute of the flag naming its PEM file.
_PEM_FLAGS = {
    "root_certificates": "tls_ca",
    "certificate_chain": "tls_cert",
    "private_key": "tls_key",
}


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SystemExit(f"pergrad: {flag} {path!r} cannot be read: {err.strerror}") from None


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    """GradientClient's TLS and token arguments from the flags (and PERGRAD_TOKEN)."""
    found: dict[str, Any] = {
        keyword: _read(getattr(args, attr), "--" + attr.replace("_", "-"))
        for keyword, attr in _PEM_FLAGS.items()
        if getattr(args, attr)
    }
    if ("certificate_chain" in found) != ("private_key" in found):
        raise SystemExit("pergrad: --tls-cert and --tls-key go together")
    token = os.environ.get("PERGRAD_TOKEN", "").strip() or None
    if args.token_file:
        token = _read(args.token_file, "--token-file").decode().strip()
        if not token:
            raise SystemExit(f"pergrad: --token-file {args.token_file!r} is empty")
    return found | {"tls": args.tls, "token": token}


def _connect(args: argparse.Namespace) -> GradientClient:
    return GradientClient(args.target, timeout=args.timeout, **_credentials(args))


def _info(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        names = [args.model] if args.model else client.list_models()
        print("\n".join(_describe(client.model_info(name)) for name in names))
    return 0


def _batches(x: np.ndarray, y: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for start in range(0, len(x), size):
        yield x[start : start + size], y[start : start + size]


# Per-example fields are written row by row; the others are summed over all batches.
_PER_EXAMPLE = {"losses": "losses", "norms": "norms", "projections": "projections"}
_PER_EXAMPLE_BY_VARIABLE = {"gradients": "grad", "variable_norms": "norm"}
_SUMMED_BY_VARIABLE = {"sum": "sum", "sum_squares": "sum_squares"}


def _named(result: GradientResult) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-example arrays, arrays summed over batches) of one result, by npz key."""
    rows = {key: getattr(result, field) for field, key in _PER_EXAMPLE.items()}
    rows = {key: value for key, value in rows.items() if value is not None}
    for field, prefix in _PER_EXAMPLE_BY_VARIABLE.items():
        rows |= {f"{prefix}/{name}": v for name, v in getattr(result, field).items()}
    sums = {}
    for field, prefix in _SUMMED_BY_VARIABLE.items():
        sums |= {f"{prefix}/{name}": v for name, v in getattr(result, field).items()}
    return rows, sums


def _grads(args: argparse.Namespace) -> int:
    with np.load(args.data) as data:
        x, y = data[args.x_key], data[args.y_key]
    if len(x) != len(y):
        raise SystemExit(f"{args.data}: {len(x)} inputs but {len(y)} labels")
    options = {"dim": args.dim, "seed": args.seed} if args.reduction == "project" else {}
    out: dict[str, np.ndarray] = {}
    with _connect(args) as client:
        results = client.stream(
            args.model,
            _batches(x, y, args.batch_size),
            reduction=args.reduction,
            variables=args.variables,
            **options,
        )
        progress = tqdm(total=len(x), unit="ex", disable=args.quiet)
        start = 0
        for result in results:
            stop = start + result.batch_size
            rows, sums = _named(result)
            for key, value in rows.items():
                if key not in out:
                    out[key] = np.empty((len(x), *value.shape[1:]), dtype=value.dtype)
                out[key][start:stop] = value
            for key, value in sums.items():
                out[key] = out[key] + value if key in out else value.copy()
            out["model_version"] = np.asarray(result.model_version)
            start = stop
            progress.update(result.batch_size)
        progress.close()
    np.savez(args.out, **out)
    print(f"wrote {args.out}: {len(x)} examples, {len(out) - 1} arrays ({args.reduction})")
    return 0


def _serve(argv: Sequence[str]) -> int:
    try:
        from pergrad.server.main import serve
    except ImportError as err:
        print(
            f"pergrad serve needs the server: pip install 'pergrad[server]' ({err})",
            file=sys.stderr,
        )
        return 2
    return serve(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pergrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run a server (flags: pergrad serve --help)", add_help=False)
    for name, help_text in [("info", "describe served models"), ("grads", "gradients of a .npz")]:
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--target", default=DEFAULT_TARGET, help="server address (PERGRAD_TARGET)")
        cmd.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
        _add_security_arguments(cmd)
    info = sub.choices["info"]
    info.add_argument("--model", help="one model (default: all)")
    grads = sub.choices["grads"]
    grads.add_argument("--model", required=True)
    grads.add_argument("--data", required=True, help=".npz with inputs and labels")
    grads.add_argument("--out", required=True, help=".npz to write")
    grads.add_argument("--x-key", default="x", help="inputs array in --data")
    grads.add_argument("--y-key", default="y", help="labels array in --data")
    grads.add_argument("--batch-size", type=int, default=64)
    grads.add_argument(
        "--reduction",
        default="none",
        choices=["none", "norms", "moments", "project"],
        help="none: grad/<variable> [N, *shape]; norms: norms [N], norm/<variable>; "
        "moments: sum/<variable>, sum_squares/<variable>; project: projections [N, dim]",
    )
    grads.add_argument("--variables", nargs="+", help="only these variables")
    grads.add_argument("--dim", type=int, default=512, help="features per example (project)")
    grads.add_argument("--seed", type=int, default=0, help="projection seed (project)")
    grads.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _add_security_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    cmd.add_argument("--tls-ca", help="PEM of the CA that signs the server (implies --tls)")
    cmd.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    cmd.add_argument("--tls-key", help="PEM private key of --tls-cert")
    cmd.add_argument("--token-file", help="file holding the bearer token (default: PERGRAD_TOKEN)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return {"info": _info, "grads": _grads}[args.command](args)
    except PergradError as err:
        print(f"pergrad {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
