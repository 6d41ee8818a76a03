"""`make bench` (recurrent): an LSTM, GRU and SimpleRNN text classifier, B=256, by the
closed-form recurrent rule against the generic route (vectorized_map over examples).

The model: token ids [B, 64] (vocabulary 10,000) -> Embedding(64) -> the recurrent layer
(64 units, fixed length) -> Dense(2). `rule` is the engine as it ships; `generic` the same
engine with the recurrent rule left out of its registry, so that layer's variables take
the vectorized route (XLA chosen as the engine chooses it). Each configuration runs in a
process of its own; full gradients refill the previous result (`out=`). `mean_grad` is
TensorFlow's ordinary gradient of the mean loss, the floor.

    python benchmarks/recurrent.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, run_child

BATCH, STEPS, VOCABULARY = 256, 64, 10_000
LAYERS = ("LSTM", "GRU", "SimpleRNN")
ROUTES = ("rule", "generic")


def _model(layer: str):
    import keras

    init = keras.initializers.GlorotUniform
    ids = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, 64, embeddings_initializer=init(1))(ids)
    h = getattr(keras.layers, layer)(64, kernel_initializer=init(2))(h)
    return keras.Model(ids, keras.layers.Dense(2, kernel_initializer=init(3))(h))


def child(layer: str, route: str, repeats: int) -> None:
    """Medians (ms) of the engine's full gradients, norms and clipped sum, and mean_grad."""
    import json

    import numpy as np
    import tensorflow as tf

    from pergrad.server.engine import Engine
    from pergrad.server.engine.rules import default_registry
    from pergrad.server.engine.rules.recurrent import LAYERS as RECURRENT

    model = _model(layer)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    registry = default_registry()
    if route == "generic":
        registry = registry.without(RECURRENT)
    engine = Engine(model, loss=loss, registry=registry)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCABULARY, (BATCH, STEPS)).astype(np.int32)
    y = rng.integers(0, 2, BATCH).astype(np.int32)
    out = engine.per_example_gradients(x, y)

    @tf.function
    def mean_grad(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=False))
        return tape.gradient(value, model.trainable_variables)

    methods = {
        "full": lambda: engine.per_example_gradients(x, y, out=out),
        "norms": lambda: engine.per_example_gradients(x, y, reduction="norms"),
        "clipped_sum": lambda: engine.per_example_gradients(
            x, y, reduction="clipped_sum", max_norm=1.0
        ),
        "mean_grad": lambda: [tf.convert_to_tensor(g).numpy() for g in mean_grad(x, y)],
    }
    medians = interleaved_medians(methods, repeats=repeats)
    print(json.dumps({k: 1000 * v for k, v in medians.items()} | {"plan": engine.summary}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.repeats)
        return
    print(
        f"| layer (B={BATCH}, T={STEPS}) | route | full ms | norms ms | clipped_sum ms | "
        "mean_grad ms | norms / mean_grad |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for layer in LAYERS:
        for route in ROUTES:
            m = run_child(Path(__file__), ["--repeats", str(args.repeats), "--child", layer, route])
            if "crashed" in m:
                print(f"| {layer} | {route} | crashed ({m['crashed']}) | | | | |")
                continue
            print(
                f"| {layer} | {route} | {m['full']:.1f} | {m['norms']:.1f} | "
                f"{m['clipped_sum']:.1f} | {m['mean_grad']:.1f} | "
                f"{m['norms'] / m['mean_grad']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
