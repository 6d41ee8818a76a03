"""A batch larger than one request: what sending it in parts costs a trainer.

Two `pergrad serve` processes: one with the default message limit (auto: 4 MiB plus the
largest served model's variables), whose client sends a large batch in parts, and one
whose limit (256 MiB) takes the batch in one request. For each model, batch size and
reduction, interleaved rounds time one `per_example_gradients` call on each; reported:
the parts a call took, the medians in ms, and their ratio (parts over one request).

    python benchmarks/split.py [--batch-sizes 1024 4096] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport import cnn_batch, mlp_batch

from pergrad.client import GradientClient
from pergrad.client._call import Call  # the client's own rule for the parts
from pergrad.client.local import LocalServer

WHOLE_LIMIT = 256 << 20
MODES = {
    "norms": {"reduction": "norms"},
    "clipped_sum": {"reduction": "clipped_sum", "max_norm": 1.0, "noise_multiplier": 1.0},
}
BATCHES = {"mnist_mlp": mlp_batch, "mnist_cnn": cnn_batch}


def _timed(client: GradientClient, model: str, batch, options: dict) -> float:
    start = time.perf_counter()
    client.per_example_gradients(model, *batch, **options)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    flags = ("--model", "mnist_mlp", "--model", "mnist_cnn", "--jit-compile", "off")
    with (
        LocalServer(*flags) as split_server,
        LocalServer(*flags, "--max-request-bytes", str(WHOLE_LIMIT)) as whole_server,
        GradientClient(split_server.target, timeout=600) as split,
        GradientClient(whole_server.target, timeout=600) as whole,
    ):
        print("| model | B | mode | parts | one request ms | in parts ms | ratio |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
        for model, make in BATCHES.items():
            info = split.model_info(model)
            for size in args.batch_sizes:
                batch = make(size)
                per_request = info.limits.max_request_bytes
                for mode, options in MODES.items():
                    fits = Call.of(model, **options).examples_per_request(info, *batch)
                    times: dict[str, list[float]] = {"whole": [], "split": []}
                    for client in (whole, split):  # warm-up
                        _timed(client, model, batch, options)
                    for _ in range(args.rounds):
                        times["whole"].append(_timed(whole, model, batch, options))
                        times["split"].append(_timed(split, model, batch, options))
                    one, parts = (1000 * statistics.median(times[k]) for k in ("whole", "split"))
                    count = -(-size // fits)
                    print(
                        f"| {model} | {size} | {mode} | {count} ({per_request >> 10} KiB) | "
                        f"{one:.1f} | {parts:.1f} | {parts / one:.2f} |"
                    )


if __name__ == "__main__":
    main()
