"""`make bench` (convolutions): per-example norms and clipped sums of CNNs against the
ordinary mean gradient, for mnist_cnn and the model zoo's convolutional families.

A conv kernel's per-example norm comes from the Gram matrices of its patches and of its
output gradients over positions where that is cheaper than forming the kernel, else from
the formed kernel (chosen per layer); the clipped sum is one weighted contraction. Each
family runs in a process of its own, XLA off (so that only the algebra differs between
two checkouts), medians of interleaved calls.

    python benchmarks/conv_norms.py [--batch-size 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, run_child

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ["mnist_cnn", "cnn_batch_norm", "depthwise_separable", "mobilenet_v3_small", "resnet50"]


def _model(name: str, batch: int):
    """(model, loss, x, y) of a built-in model or a zoo family (tests/zoo.py)."""
    if name == "mnist_cnn":
        import numpy as np

        from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS

        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, 28, 28, 1)).astype(np.float32)
        return BUILTIN_MODELS[name](), LOSS, x, rng.integers(0, 10, batch).astype(np.int32)
    sys.path.insert(0, str(ROOT))
    from tests.zoo import FAMILIES as ZOO

    model, loss = ZOO[name].build()
    x, y = ZOO[name].batch(model, batch)
    return model, getattr(model, "loss", None) or loss, x, y


def child(name: str, batch: int, repeats: int) -> None:
    """Medians (ms) of mean_grad, norms and clipped_sum for one family."""
    import tensorflow as tf

    from pergrad.server.engine import Engine

    model, loss, x, y = _model(name, batch)
    loss_fn = tf.keras.losses.get(loss) if isinstance(loss, str) else loss
    engine = Engine(model, loss=loss, jit_compile=False)

    @tf.function
    def mean_grad(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=False))
        return tape.gradient(value, model.trainable_variables)

    methods = {
        "mean_grad": lambda: [g.numpy() for g in mean_grad(x, y)],
        "norms": lambda: engine.per_example_gradients(x, y, reduction="norms"),
        "clipped_sum": lambda: engine.per_example_gradients(
            x, y, reduction="clipped_sum", max_norm=1.0
        ),
    }
    medians = interleaved_medians(methods, repeats=repeats)
    print(json.dumps({k: 1000 * v for k, v in medians.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch_size, args.repeats)
        return
    print(
        f"| family (B={args.batch_size}) | mean_grad ms | norms ms | clipped_sum ms | "
        "norms / mean_grad | clipped_sum / mean_grad |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.families:
        flags = ["--batch-size", str(args.batch_size), "--repeats", str(args.repeats)]
        m = run_child(Path(__file__), [*flags, "--child", name])
        if "crashed" in m:
            print(f"| {name} | crashed ({m['crashed']}) | | | | |")
            continue
        print(
            f"| {name} | {m['mean_grad']:.1f} | {m['norms']:.1f} | {m['clipped_sum']:.1f} | "
            f"{m['norms'] / m['mean_grad']:.2f} | {m['clipped_sum'] / m['mean_grad']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
