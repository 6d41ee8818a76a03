"""`pergrad info` and `pergrad grads`: the client's commands.

`grads` takes a flag for every option of every reduction in the catalogue (`--max-norm`,
`--dim`, ..., `--reference FILE.npz` for tensor options) and writes every output the
chosen reduction returns: per-example rows for all examples, sums over all batches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
from tqdm import tqdm

from pergrad.cli.connect import add_connection_arguments, connect
from pergrad.client import GradientResult, ModelInfo, PergradError
from pergrad.wire.casting import rows
from pergrad.wire.catalogue import CATALOGUE, STEP_SUMS, Option


def _describe(info: ModelInfo) -> str:
    lines = [
        f"{info.name}  version {info.model_version}  {info.num_parameters:,} parameters",
        f"  input   {info.input.dtype.name} {list(info.input.shape)}",
        f"  labels  {info.labels.dtype.name} {list(info.labels.shape)}"
        + (f"  classes {info.num_classes}" if info.num_classes else ""),
        f"  loss    {info.loss}",
        f"  plan    {info.plan_id}  {info.plan}",
        f"  steps   {info.optimizer or 'not offered by this server'}"
        + (f"  (Keras {info.keras_version})" if info.optimizer and info.keras_version else ""),
        f"  lora    {info.lora or 'off: every variable trains'}",
        "  limits  "
        + "  ".join(f"{f.name} {getattr(info.limits, f.name)}" for f in fields(info.limits)),
    ]
    routes = info.route_of
    lines += [
        f"  var     {v.name}  {v.dtype.name} {list(v.shape)}  {routes.get(v.name, '')}".rstrip()
        for v in info.variables
    ]
    return "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    with connect(args) as client:
        names = [args.model] if args.model else client.list_models()
        print("\n".join(_describe(client.model_info(name)) for name in names))
    return 0


def _batches(x: Any, y: np.ndarray, size: int) -> Iterator[tuple[Any, np.ndarray]]:
    for start in range(0, len(y), size):
        part = slice(start, start + size)
        yield rows(x, part), y[part]


def _read_data(args: argparse.Namespace, info: ModelInfo) -> tuple[Any, np.ndarray]:
    """Labels (--y-key) and inputs from the .npz: --x-key for a model of one input, else
    one array per input, named as the model names them."""
    names = [i.name for i in info.inputs]
    with np.load(args.data) as data:
        keys = [args.x_key] if len(names) == 1 else names
        missing = [key for key in [*keys, args.y_key] if key not in data.files]
        if missing:
            raise SystemExit(f"{args.data}: no arrays {missing}; it holds {data.files}")
        x = data[args.x_key] if len(names) == 1 else {name: data[name] for name in names}
        y = data[args.y_key]
    sizes = {len(a) for a in ([x] if len(names) == 1 else x.values())}
    if sizes != {len(y)}:
        raise SystemExit(f"{args.data}: inputs of {sorted(sizes)} examples but {len(y)} labels")
    return x, y


def _flag(option: Option) -> str:
    return "--" + option.name.replace("_", "-")


def _option_value(option: Option, value: Any) -> Any:
    """A flag's value as the client takes it: a tensor option's .npz read into arrays."""
    if option.kind != "tensors":
        return value
    try:
        with np.load(value) as arrays:
            return {name: arrays[name] for name in arrays.files}
    except OSError as err:
        raise SystemExit(f"pergrad: {_flag(option)} {value!r} cannot be read: {err}") from None


def _reduction_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the chosen reduction takes (flags of other reductions are not sent)."""
    reduction = CATALOGUE.get(args.reduction)
    given = {o.name: getattr(args, o.name) for o in reduction.options}
    return {
        o.name: _option_value(o, given[o.name])
        for o in reduction.options
        if given[o.name] is not None
    }


class _Written:
    """The arrays `grads` writes, gathered batch by batch as the catalogue says."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, result: GradientResult, start: int) -> None:
        stop = start + result.batch_size
        self._rows("losses", result.losses, start, stop)
        for field, value in result.outputs.items():
            output = CATALOGUE.output(field)
            named = value.items() if output.per_variable else [("", value)]
            for variable, array in named:
                key = f"{output.prefix}/{variable}" if variable else output.prefix
                if output.rows == "example":
                    self._rows(key, np.asarray(array), start, stop)
                else:
                    self.arrays[key] = self.arrays[key] + array if key in self.arrays else array
        self.arrays["model_version"] = np.asarray(result.model_version)

    def _rows(self, key: str, value: np.ndarray, start: int, stop: int) -> None:
        if key not in self.arrays:
            self.arrays[key] = np.empty((self.total, *value.shape[1:]), dtype=value.dtype)
        self.arrays[key][start:stop] = value


def _grads(args: argparse.Namespace) -> int:
    with connect(args) as client:
        x, y = _read_data(args, client.model_info(args.model))
        written = _Written(len(y))
        results = client.stream(
            args.model,
            _batches(x, y, args.batch_size),
            reduction=args.reduction,
            variables=args.variables,
            **_reduction_options(args),
        )
        progress = tqdm(total=len(y), unit="ex", disable=args.quiet)
        start = 0
        for result in results:
            written.add(result, start)
            start += result.batch_size
            progress.update(result.batch_size)
        progress.close()
    arrays: dict[str, Any] = written.arrays  # savez's stub types allow_pickle among them
    np.savez(args.out, **arrays)
    count = len(written.arrays) - 1
    print(f"wrote {args.out}: {len(y)} examples, {count} arrays ({args.reduction})")
    return 0


def _steps(args: argparse.Namespace) -> int:
    """Training steps on the server over the .npz, a batch per step, in order; a line per
    epoch of what a trainer logs."""
    given = {"max_norm": args.max_norm, "noise_multiplier": args.noise_multiplier}
    options = (
        {} if args.reduction == "moments" else {k: v for k, v in given.items() if v is not None}
    )
    with connect(args) as client:
        x, y = _read_data(args, client.model_info(args.model))
        if not len(y):
            raise SystemExit(f"{args.data}: no examples")
        for epoch in range(1, args.epochs + 1):
            losses, clipped = [], 0
            for xb, yb in _batches(x, y, args.batch_size):
                done = client.step(
                    args.model,
                    xb,
                    yb,
                    learning_rate=args.learning_rate,
                    expected_batch_size=args.expected_batch_size,
                    reduction=args.reduction,
                    **options,
                )
                losses.append(done.losses)
                clipped += done.num_clipped
            print(
                f"epoch {epoch}: version {done.model_version}, mean loss "
                f"{np.concatenate(losses).mean():.4f}, clipped {clipped} of {len(y)} examples"
            )
    print(f"weights_id {done.weights_id}")
    return 0


def _add_reduction_arguments(grads: argparse.ArgumentParser) -> None:
    outputs = {
        r.name: ", ".join(o.prefix + ("/<variable>" if o.per_variable else "") for o in r.outputs)
        for r in CATALOGUE.reductions.values()
    }
    grads.add_argument(
        "--reduction",
        default="none",
        choices=CATALOGUE.names,
        help="what to compute and write, besides losses: "
        + "; ".join(f"{name}: {written}" for name, written in outputs.items()),
    )
    for option in CATALOGUE.options():
        takers = [r.name for r in CATALOGUE.reductions.values() if option.name in r.option_names]
        help_text = f"{option.help} ({', '.join(takers)})"
        if option.kind == "tensors":
            grads.add_argument(_flag(option), help=f"{help_text}: a .npz of arrays by variable")
        elif option.kind == "choice":
            grads.add_argument(_flag(option), choices=option.choices, help=help_text)
        else:
            kind = float if option.kind == "float" else int
            grads.add_argument(_flag(option), type=kind, help=help_text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pergrad", description="Per-example gradients from a pergrad server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run a server (flags: pergrad serve --help)", add_help=False)
    commands = [
        ("info", "describe served models"),
        ("grads", "gradients of a .npz"),
        ("step", "training steps on the server over a .npz (its --optimizer)"),
    ]
    for name, help_text in commands:
        add_connection_arguments(sub.add_parser(name, help=help_text))
    sub.choices["info"].add_argument("--model", help="one model (default: all)")
    grads = sub.choices["grads"]
    grads.add_argument("--model", required=True)
    grads.add_argument("--data", required=True, help=".npz with inputs and labels")
    grads.add_argument("--out", required=True, help=".npz to write")
    grads.add_argument(
        "--x-key",
        default="x",
        help="inputs array in --data (a model of several inputs reads one array per input "
        "name instead)",
    )
    grads.add_argument("--y-key", default="y", help="labels array in --data")
    grads.add_argument("--batch-size", type=int, default=64)
    grads.add_argument("--variables", nargs="+", help="only these variables")
    _add_reduction_arguments(grads)
    grads.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_step_arguments(sub.choices["step"])
    return parser


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_step_arguments(step: argparse.ArgumentParser) -> None:
    step.add_argument("--model", required=True)
    step.add_argument("--data", required=True, help=".npz with inputs and labels")
    step.add_argument("--x-key", default="x", help="inputs array in --data")
    step.add_argument("--y-key", default="y", help="labels array in --data")
    step.add_argument("--batch-size", type=int, default=64, help="examples per step")
    step.add_argument("--epochs", type=_at_least_one, default=1)
    step.add_argument("--learning-rate", type=float, required=True)
    step.add_argument(
        "--expected-batch-size",
        type=float,
        default=0,
        help="the sum is divided by this (DP-SGD with Poisson sampling); 0: the batch's mean",
    )
    step.add_argument(
        "--reduction",
        default="clipped_sum",
        choices=sorted(STEP_SUMS),
        help="clipped_sum: DP-SGD (--max-norm, --noise-multiplier; fresh noise); "
        "moments: the plain sum",
    )
    step.add_argument("--max-norm", type=float, help="clipping bound C (clipped_sum)")
    step.add_argument("--noise-multiplier", type=float, help="sigma (clipped_sum)")


def run(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"info": _info, "grads": _grads, "step": _steps}[args.command](args)
    except PergradError as err:
        print(f"pergrad {args.command}: {err}", file=sys.stderr)
        return 1
