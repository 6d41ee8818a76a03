"""`make bench` (projections): `project` with one repeated seed and with a fresh seed on
every call, by projection size, and the process's RSS after the calls.

Random matrices are a pure function of the seed; whole ones are cached within a bound
of bytes, and a matrix too large for the cache is made a block of rows at a time on
every call. This shows what a repeated seed gains, what a fresh one costs, and that
memory stays bounded whatever seeds callers send. mnist_mlp, B=64, XLA off; each size in
a process of its own; medians of interleaved calls.

    python benchmarks/project_seeds.py [--dims 512 8192 65536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import current_rss_bytes, interleaved_medians, run_child

BATCH = 64


def child(dim: int, repeats: int) -> None:
    """Medians (ms) of a repeated seed and of fresh seeds at `dim`, and the RSS after."""
    import numpy as np

    from pergrad.server.engine import Engine
    from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

    engine = Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 784)).astype(np.float32)
    y = rng.integers(0, 10, BATCH).astype(np.int32)
    seeds = itertools.count(1000)

    def project(seed: int) -> object:
        return engine.per_example_gradients(x, y, reduction="project", dim=dim, seed=seed)

    medians = interleaved_medians(
        {"repeated": lambda: project(7), "fresh": lambda: project(next(seeds))},
        repeats=repeats,
    )
    result = {k: 1000 * v for k, v in medians.items()}
    print(json.dumps(result | {"rss_mb": current_rss_bytes() / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dims", nargs="+", type=int, default=[512, 8192, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.repeats)
        return
    print(f"| dim (mnist_mlp, B={BATCH}) | repeated seed ms | fresh seed ms | RSS after, MB |")
    print("| ---: | ---: | ---: | ---: |")
    for dim in args.dims:
        m = run_child(Path(__file__), ["--repeats", str(args.repeats), "--child", str(dim)])
        print(
            f"| {dim} | {m['repeated']:.1f} | {m['fresh']:.1f} | {m['rss_mb']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
