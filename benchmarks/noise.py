"""Gaussian noise for a DP step: what a model's noise costs against writing its floats.

For each model (mnist_mlp's 101,770 parameters, a stream per variable as the server draws
them; the GPT-2-shaped classifier's 14.5M of `gpt2_dp.py`, as one stream), medians of
interleaved rounds of:

  write        np.full of the same float32 array: memory speed, the issue's yardstick
  seeded       the server's seeded noise (`random_streams.gaussians`, a stream a variable)
  fresh        the server's fresh noise (`secure_gaussians`: ChaCha20 keyed by getrandom)
  numpy rule   the contract's rule written in numpy with libm's ln, cos and sin (what
               the server ran before the compiled rule)
  ChaCha20     `secure_bits` alone: the words fresh noise reads now (8 bytes an entry)
  getrandom    os.urandom of the bytes fresh noise used to read (4 an entry)
  PCG64        numpy's standard_normal in float32 (not the contract's stream; not secure)

The compiled rule's entries are also compared with the numpy rule's, all of them.

    python benchmarks/noise.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians

from pergrad.server.engine.reductions.random_streams import (
    gaussians,
    secure_bits,
    secure_gaussians,
    stream_key,
)
from pergrad.server.models.builtin import BUILTIN_MODELS


def _variable_sizes(model: str) -> list[int]:
    return [int(np.prod(v.shape)) for v in BUILTIN_MODELS[model]().trainable_variables]


SIZES = {"mnist_mlp": _variable_sizes("mnist_mlp"), "gpt2-shaped": [14_500_000]}
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def numpy_rule(key: int, count: int) -> np.ndarray:
    """The contract's GAUSSIAN stream in numpy float64 with libm: the independent reference."""
    z = np.arange((count + 1) // 2, dtype=np.uint64) ^ np.uint64(key)
    z += np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    z ^= z >> np.uint64(31)
    u1 = ((z >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = ((z & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * 2.0**-32
    radius, angle = np.sqrt(-2.0 * np.log(u1)), u2 * (2.0 * np.pi)
    pairs = np.stack([(radius * np.cos(angle)), (radius * np.sin(angle))], axis=1)
    return pairs.astype(np.float32).reshape(-1)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'size':>12} {'method':>11} {'ms':>8} {'ns/entry':>9} {'x write':>8}")
    for name, sizes in SIZES.items():
        count, streams = sum(sizes), [stream_key(7, i, 2) for i in range(len(sizes))]
        times = interleaved_medians(
            {
                "write": lambda count=count: np.full(count, 1.0, np.float32),
                "seeded": lambda streams=streams, sizes=sizes: gaussians(streams, sizes),
                "fresh": lambda sizes=sizes: secure_gaussians(sizes),
                "numpy rule": lambda streams=streams, sizes=sizes: [
                    numpy_rule(key, size) for key, size in zip(streams, sizes, strict=True)
                ],
                "ChaCha20": lambda count=count: secure_bits(count),
                "getrandom": lambda count=count: os.urandom(4 * count),
                "PCG64": lambda count=count: rng.standard_normal(count, np.float32),
            },
            repeats=args.rounds,
        )
        for method, seconds in times.items():
            print(
                f"{name:>12} {method:>11} {seconds * 1e3:8.2f} {seconds / count * 1e9:9.2f} "
                f"{seconds / times['write']:8.1f}"
            )
        differ = sum(
            np.count_nonzero(entries != numpy_rule(key, size))
            for entries, key, size in zip(gaussians(streams, sizes), streams, sizes, strict=True)
        )
        print(f"{name:>12} compiled rule's entries unlike the numpy rule's: {differ} of {count}")


if __name__ == "__main__":
    main()
