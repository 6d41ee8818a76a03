"""`make bench` (gpt2_dp): DP fine-tuning of a GPT-2-shaped classifier at the size users
run it, against the plain training step on the same batch.

The model: keras-hub's GPT2Backbone (2 layers, hidden 256, 4 heads, FFN 1024, a
vocabulary of 50,257, T=128; 14.5M parameters, random init, nothing downloaded) with a
2-class head on the first token, served from a `.keras` file by `pergrad serve
--optimizer adam`, once with `--jit-compile auto` (the default) and once `off` (as the
images and manifests ship). In turns, medians of the rounds:

  plain      the local plain Keras step on the same batch: tape gradient of the mean loss
             and Adam's update in one tf.function, without XLA and with it
  norms      `per_example_gradients(reduction="norms")` through the server
  clipped    `clipped_sum` with fresh noise from the server's secure source
  DP step    `client.step`: the server clips, sums, noises and applies Adam

LoRA: the same file served with `--lora rank=4` (the attention's query and value, the head
trainable), against the plain step of the same model with LoRA enabled the same way.

Memory: the server's peak RSS over its RSS once loaded, against what the plain step adds
to a process's peak (each in a process of its own).

`--phases`: where a DP step's time goes, in-process, each phase timed alone in turns
(medians), beside the plain step's own phases: the forward pass, the tape gradient, Adam;
the engine's pass with the clipped sum in it (no noise), its norms alone, fresh secure
noise for every parameter, the server's Adam update (`Trainer.apply`) and the digest of
the new weights. With each, the arithmetic a pass must do (multiply-adds of the dense
layers' matrix products: forward, input gradient, weight gradient, ghost norms) to show
what a DP step cannot avoid at this shape.

    python benchmarks/gpt2_dp.py [--batches 16 32] [--rounds 5] [--jit auto off] [--lora 0 4]
    python benchmarks/gpt2_dp.py --phases [--batches 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import peak_rss_bytes, reset_peak_rss, run_child

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer

VOCABULARY = 50_257
STEPS = 128
CLASSES = 2
LORA_RANK = 4
MODEL = "gpt2_classifier"
DP = {"max_norm": 1.0, "noise_multiplier": 1.0}  # no seed: fresh noise


def build(*, lora: int = 0):
    """The classifier and its loss, seeded; with LoRA of that rank enabled as the server's
    --lora does."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=4,
        hidden_dim=256,
        intermediate_dim=1024,
        max_sequence_length=STEPS,
    )
    inputs = {i.name: keras.Input((STEPS,), dtype=i.dtype, name=i.name) for i in backbone.inputs}
    logits = keras.layers.Dense(CLASSES, name="head")(backbone(inputs)[:, 0])
    model = keras.Model(inputs, logits, name=MODEL)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss)
    if lora:
        from pergrad.server.lora_spec import parse_lora
        from pergrad.server.models.lora import enable_lora

        enable_lora(model, parse_lora(f"rank={lora}"))
    return model, loss


def batch(size: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(size)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (size, STEPS)).astype(np.int32),
        "padding_mask": np.ones((size, STEPS), np.int32),
    }
    return x, rng.integers(0, CLASSES, size).astype(np.int32)


def plain_step(model, loss, x, y, *, jit: bool) -> Callable[[], None]:
    """The local plain training step: mean loss, tape gradient, Adam, one tf.function."""
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(1e-4)
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=False))
        optimizer.apply(tape.gradient(value, variables), variables)

    tx = {k: tf.constant(v) for k, v in x.items()}
    ty = tf.constant(y)
    return lambda: step(tx, ty)


def _medians(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in methods.values():  # tracing, allocation
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def _rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def served(model_dir: Path, jit: str, sizes: list[int], rounds: int, lora: int) -> dict:
    """Each size's medians through a server of `--jit-compile jit` (and `--lora rank=lora`),
    with the plain steps; and the server's peak RSS over its RSS once loaded."""
    server = LocalServer(
        "--model-dir", str(model_dir), "--model", f"{MODEL}.keras",
        "--optimizer", "adam", "--jit-compile", jit, *(["--lora", f"rank={lora}"] if lora else []),
    )  # fmt: skip
    model, loss = build(lora=lora)
    out: dict = {}
    try:
        idle = _rss(server.process.pid, "VmRSS")
        with GradientClient(server.target, timeout=600) as client:
            info = client.model_info(MODEL)
            out["plan"] = info.plan
            for size in sizes:
                x, y = batch(size)
                methods = {
                    "plain": plain_step(model, loss, x, y, jit=False),
                    "plain_xla": plain_step(model, loss, x, y, jit=True),
                    "norms": lambda x=x, y=y: client.per_example_gradients(
                        MODEL, x, y, reduction="norms"
                    ),
                    "clipped": lambda x=x, y=y: client.per_example_gradients(
                        MODEL, x, y, reduction="clipped_sum", **DP
                    ),
                    "step": lambda x=x, y=y, size=size: client.step(
                        MODEL, x, y, learning_rate=1e-4, expected_batch_size=size, **DP
                    ),
                }
                out[size] = _medians(methods, rounds)
        out["server_peak_over_idle"] = _rss(server.process.pid, "VmHWM") - idle
    finally:
        server.stop()
    return out


def plain_peak(size: int) -> None:
    """(child) What one plain step adds to this process's peak RSS, printed."""
    model, loss = build()
    x, y = batch(size)
    step = plain_step(model, loss, x, y, jit=False)
    reset_peak_rss()
    before = peak_rss_bytes()
    for _ in range(3):
        step()
    print(json.dumps({"bytes": peak_rss_bytes() - before}))


def _dense_shapes(model) -> list[tuple[int, int, int]]:
    """(steps, inputs, outputs) of each kernel applied to every token (EinsumDense and
    Dense on [B, T, I]); the head's kernel, on one token, as steps 1."""
    out = []
    for v in model.trainable_variables:
        if len(v.shape) < 2 or "embedding" in v.path:
            continue
        inputs = v.shape[0]
        outputs = int(np.prod(v.shape[1:]))
        if len(v.shape) == 3 and "attention_output" in v.path:  # [heads, head_dim, hidden]
            inputs, outputs = v.shape[0] * v.shape[1], v.shape[2]
        out.append((1 if "head" in v.path else STEPS, inputs, outputs))
    return out


def arithmetic(model, size: int) -> dict[str, float]:
    """Multiply-adds (G) of the matrix products each pass does over the batch's tokens:
    forward, input gradient and weight gradient each B T I J per kernel; ghost norms
    min(B T^2 (I + J), B T I J) (the Gram matrices or the per-example matrix)."""
    dense = _dense_shapes(model)
    product = sum(size * t * i * j for t, i, j in dense) / 1e9
    ghost = sum(min(size * t * t * (i + j), size * t * i * j) for t, i, j in dense) / 1e9
    return {"forward": product, "input_gradient": product, "weight_gradient": product,
            "ghost_norms": ghost}  # fmt: skip


def phases(size: int, rounds: int, jit: bool) -> dict[str, float]:
    """Each phase of the plain step and of the server's DP step, in-process, timed alone."""
    import keras
    import tensorflow as tf

    from pergrad.server.engine import Engine
    from pergrad.server.engine.reductions.random_streams import secure_gaussians
    from pergrad.server.optimizer_spec import parse_optimizer
    from pergrad.server.training import Trainer
    from pergrad.server.weights import weights_id

    model, loss = build()
    x, y = batch(size)
    variables = model.trainable_variables
    tx, ty = {k: tf.constant(v) for k, v in x.items()}, tf.constant(y)

    @tf.function(jit_compile=jit)
    def forward(x, y):
        return loss(y, model(x, training=False))

    @tf.function(jit_compile=jit)
    def gradient(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=False))
        return tape.gradient(value, variables)

    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(variables)
    grads = gradient(tx, ty)

    @tf.function(jit_compile=jit)
    def adam(grads):
        optimizer.apply(grads, variables)

    engine = Engine(model, loss=loss, jit_compile=jit)
    data = engine.batch(x, y)
    counts = [int(np.prod(v.shape)) for v in variables]
    trainer = Trainer(model, parse_optimizer("adam"))
    weights = [tf.identity(v.value) for v in variables]
    dense = [tf.convert_to_tensor(g) for g in grads]  # the embedding's come as slices
    state = trainer.apply(weights, None, dense, 1e-4).state
    arrays = [w.numpy() for w in weights]
    methods = {
        "plain forward": lambda: forward(tx, ty),
        "plain tape gradient": lambda: gradient(tx, ty),
        "plain Adam": lambda: adam(grads),
        "engine norms": lambda: engine.compute(data, reduction="norms"),
        "engine clipped sum, no noise": lambda: engine.compute(
            data, reduction="clipped_sum", max_norm=1.0, noise_multiplier=0.0
        ),
        "fresh secure noise": lambda: secure_gaussians(counts),
        "server Adam (Trainer.apply)": lambda: trainer.apply(weights, state, dense, 1e-4),
        "weights digest": lambda: weights_id(engine.variables, arrays),
    }
    return _medians(methods, rounds)


def print_phases(sizes: list[int], rounds: int, jits: list[str]) -> None:
    model, _ = build()
    for jit in jits:
        for size in sizes:
            m = phases(size, rounds, jit != "off")
            plain = m["plain tape gradient"] + m["plain Adam"]
            print(f"\n### B={size}, XLA {'on' if jit != 'off' else 'off'}: "
                  f"plain step's phases {1000 * plain:.0f} ms\n")  # fmt: skip
            print("| phase | ms | / plain step |")
            print("| --- | ---: | ---: |")
            for name, seconds in m.items():
                print(f"| {name} | {1000 * seconds:.1f} | {seconds / plain:.2f} |")
            work = arithmetic(model, size)
            print("\n| matrix products | G multiply-adds |\n| --- | ---: |")
            for name, amount in work.items():
                print(f"| {name} | {amount:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jit", nargs="+", default=["auto", "off"])
    parser.add_argument("--lora", type=int, nargs="+", default=[0, LORA_RANK], help="0: none")
    parser.add_argument("--phases", action="store_true", help="in-process phases only")
    parser.add_argument("--plain-peak", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases:
        print_phases(args.batches, args.rounds, args.jit)
        return
    if args.plain_peak:
        plain_peak(args.plain_peak)
        return
    with tempfile.TemporaryDirectory() as folder:
        build()[0].save(Path(folder) / f"{MODEL}.keras")
        runs = {
            (lora, jit): served(Path(folder), jit, args.batches, args.rounds, lora)
            for lora in args.lora
            for jit in args.jit
        }
    print("| LoRA | server XLA | B | plain ms (XLA off / on) | norms | clipped_sum | DP step |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for (lora, jit), run in runs.items():
        for size in args.batches:
            m = run[size]
            ratios = " | ".join(
                f"{m[k] / m['plain']:.2f}x / {m[k] / m['plain_xla']:.2f}x"
                for k in ("norms", "clipped", "step")
            )
            print(
                f"| {f'rank {lora}' if lora else 'none'} | {jit} | {size} | "
                f"{1000 * m['plain']:.0f} / {1000 * m['plain_xla']:.0f} | {ratios} |"
            )
    for (lora, jit), run in runs.items():
        print(f"server plan (LoRA {lora}, {jit}): {run['plan']}")
    for size in args.batches:
        plain = run_child(Path(__file__), ["--plain-peak", str(size)])["bytes"]
        for (lora, jit), run in runs.items():
            if lora:
                continue
            peak = run["server_peak_over_idle"]
            print(
                f"memory, B={size}, server {jit}: server peak over idle {peak / 2**20:.0f} MiB "
                f"(all sizes), plain step's {plain / 2**20:.0f} MiB: {peak / plain:.2f}x"
            )


if __name__ == "__main__":
    main()
