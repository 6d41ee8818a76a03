"""`make bench` (in_pass): one layer's in-pass norms and clipped sum where the norms form
the per-example matrices (T (I + J) >= I J), two ways in the same run: the clipped sum
weighing those matrices, B I J products (what the engine does: `in_pass.reduce`), and
contracting the factors again, B T I J (`in_pass.weighted_sum`, the route before).
Interleaved medians, float32, XLA off.

    python benchmarks/in_pass.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import tensorflow as tf
from harness import interleaved_medians

from pergrad.server.engine.grads import Outer
from pergrad.server.engine.in_pass import InPass, reduce, squared_norms, weighted_sum
from pergrad.server.engine.reductions.clipped_sum import clip_factors

# name: (B, T, I, J)
LAYERS = {
    "mnist_cnn's conv1": (256, 196, 64, 16),
    "a LoRA A factor": (32, 128, 256, 4),
    "an attention projection": (16, 128, 256, 256),
}


def _ways(b: int, t: int, i: int, j: int) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    grad = Outer(
        tf.constant(rng.standard_normal((b, t, i)), tf.float32),
        tf.constant(rng.standard_normal((b, t, j)), tf.float32),
    )
    rows, max_norm = tf.ones(b), tf.constant(1.0)

    @tf.function
    def formed() -> tf.Tensor:
        return reduce(InPass((0,), clip=True), [grad], [(i, j)], rows, max_norm)["sums"][0]

    @tf.function
    def factors() -> tf.Tensor:
        norms = tf.sqrt(squared_norms(grad))
        scale = clip_factors(norms, max_norm, ops=tf.math) * rows
        return weighted_sum(grad, scale, (i, j))

    return {"factors": lambda: factors().numpy(), "formed": lambda: formed().numpy()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print("| layer | B, T, I, J | from the factors ms | from the formed matrices ms | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, shape in LAYERS.items():
        medians = interleaved_medians(_ways(*shape), repeats=args.repeats)
        ms = {way: seconds * 1e3 for way, seconds in medians.items()}
        print(
            f"| {name} | {', '.join(map(str, shape))} | {ms['factors']:.2f} | "
            f"{ms['formed']:.2f} | {ms['formed'] / ms['factors']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
