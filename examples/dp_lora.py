"""DP-LoRA: fine-tune a keras-hub text classifier with differential privacy on the
server, training only LoRA factors and the head.

The text is real and ships inside numpy: the sentences of the docstrings of numpy's
random distributions (`numpy.random.Generator`, label 0) and of its linear algebra
(`numpy.linalg`, label 1), a word-level vocabulary built from the training sentences. The
model is a keras-hub BERT backbone (random init: nothing is downloaded) with a 2-class
head on the mean of its outputs, saved as a `.keras` file and served by `pergrad serve --lora
rank=R --optimizer adam`: the server enables LoRA on the backbone's query and value
projections at load, so the factors and the head train and everything else stays frozen.

Each step draws a Poisson batch (rate q = batch_size / N) and the server takes it
(`client.step`): it clips each example's gradient to --max-norm, sums, adds Gaussian noise
(from its secure source; seeded only with --seed, to reproduce a run), divides by qN and
applies Adam. The first step's report names
any variable it did not move (`StepResult.unmoved`): a run whose LoRA factors never change
shows at once. The privacy spent is dp-accounting's epsilon at --delta (PLD accountant)
for the steps taken; test accuracy is read from the server's per-example losses.
"""

from __future__ import annotations

import argparse
import inspect
import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import plot_epochs, print_summary
from dp_sgd import epsilon
from tqdm import tqdm

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer

MODEL = "docstring_classifier"
STEPS = 24  # tokens an example: [CLS], then the sentence's first words
PAD, UNKNOWN, CLS = 0, 1, 2


def sentences() -> tuple[list[str], np.ndarray]:
    """Sentences of numpy's docstrings (their prose: no code, no section headings): random
    sampling (0) and linear algebra and Fourier transforms (1)."""
    import numpy.fft
    import numpy.linalg

    def public(owner: object, names: Sequence[str]) -> list[object]:
        return [getattr(owner, name) for name in names if not name.startswith("_")]

    sources = [
        (0, public(np.random.Generator, dir(np.random.Generator))),
        (0, public(np.random.RandomState, dir(np.random.RandomState))),
        (1, public(numpy.linalg, numpy.linalg.__all__)),
        (1, public(numpy.fft, numpy.fft.__all__)),
    ]
    labelled: dict[str, int] = {}  # each sentence once (the two random APIs share many)
    for label, objects in sources:
        for obj in objects:
            for sentence in _prose_sentences(inspect.getdoc(obj) or ""):
                labelled.setdefault(sentence, label)
    return list(labelled), np.asarray(list(labelled.values()), np.int32)


def _prose_sentences(doc: str) -> list[str]:
    lines = [
        line
        for line in doc.splitlines()
        if line.strip() and not line.lstrip().startswith((">>>", "...", "---", "==="))
    ]
    prose = " ".join(" ".join(lines).split())
    return [s for s in re.split(r"(?<=[.!?])\s+", prose) if len(s.split()) >= 5]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


class Vocabulary:
    """Word ids from the training sentences' most frequent words; the rest are UNKNOWN."""

    def __init__(self, texts: Sequence[str], size: int) -> None:
        counts = Counter(word for text in texts for word in _words(text))
        self.ids = {w: i + 3 for i, (w, _) in enumerate(counts.most_common(size - 3))}
        self.size = size

    def encode(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        ids = np.full((len(texts), STEPS), PAD, np.int32)
        for row, text in enumerate(texts):
            words = [CLS, *(self.ids.get(w, UNKNOWN) for w in _words(text))][:STEPS]
            ids[row, : len(words)] = words
        return {
            "token_ids": ids,
            "segment_ids": np.zeros_like(ids),
            "padding_mask": (ids != PAD).astype(np.int32),
        }


def save_model(path: Path, vocabulary: int, seed: int) -> None:
    """A keras-hub BERT backbone (random init) with a 2-class head on the mean of its
    outputs over the sentence's tokens."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=1,
        num_heads=2,
        hidden_dim=128,
        intermediate_dim=256,
        max_sequence_length=STEPS,
    )
    inputs = {i.name: keras.Input((STEPS,), dtype="int32", name=i.name) for i in backbone.inputs}
    hidden = backbone(inputs)["sequence_output"]
    mask = keras.ops.expand_dims(keras.ops.cast(inputs["padding_mask"], hidden.dtype), -1)
    pooled = keras.ops.sum(hidden * mask, axis=1) / keras.ops.sum(mask, axis=1)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(pooled), name=MODEL)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(path)


def accuracy(
    client: GradientClient, x: dict[str, np.ndarray], y: np.ndarray, version: int
) -> float:
    """The label of the smaller loss is the prediction (a softmax's -log p(k | x))."""
    losses = [
        client.per_example_gradients(
            MODEL,
            x,
            np.full(len(y), label, np.int32),
            reduction="norms",
            variables=["head/bias"],
            model_version=version,
        ).losses
        for label in (0, 1)
    ]
    return float(np.mean(np.argmin(losses, axis=0) == y))


def split(x: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: value[rows] for name, value in x.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=128, help="expected batch size qN")
    parser.add_argument("--max-norm", type=float, default=3.0, help="clipping bound C")
    parser.add_argument("--noise-multiplier", type=float, default=0.8, help="sigma")
    parser.add_argument("--lr", type=float, default=0.03, help="the server's Adam's")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--vocabulary", type=int, default=1000)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--plot", help="write test accuracy and epsilon per epoch to this PNG")
    parser.add_argument(
        "--seed",
        type=int,
        help="split, sampling and noise seed, to reproduce a run (default: fresh)",
    )
    args = parser.parse_args(argv)

    texts, y = sentences()
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    vocabulary = Vocabulary([texts[i] for i in train], args.vocabulary)
    x = vocabulary.encode(texts)
    x_train, y_train, x_test, y_test = split(x, train), y[train], split(x, test), y[test]
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder) / f"{MODEL}.keras", vocabulary.size, seed=args.seed or 0)
        flags = ["--model-dir", folder, "--model", f"{MODEL}.keras", "--optimizer", "adam"]
        with (
            LocalServer(*flags, "--lora", f"rank={args.rank}") as local,
            GradientClient(local.target) as client,
        ):
            info = client.model_info(MODEL)
            q = args.batch_size / len(y_train)
            per_epoch = round(1 / q)
            print(
                f"DP-LoRA on {len(y_train)} sentences of numpy's docstrings: {info.lora}; "
                f"q={q:.4f}, C={args.max_norm}, sigma={args.noise_multiplier}, {info.optimizer}"
            )
            version = info.model_version
            progress = tqdm(total=args.epochs * per_epoch, unit="step")
            curve: dict[str, list[float]] = {"accuracy": [], "epsilon": []}
            for epoch in range(1, args.epochs + 1):
                for _ in range(per_epoch):
                    rows = np.flatnonzero(rng.random(len(y_train)) < q)  # Poisson sampling
                    # Batches and noise must stay secret: whoever knows a step's noise seed
                    # can subtract its noise. Without --seed the server draws fresh noise.
                    seed = None if args.seed is None else int(rng.integers(2**63))
                    if rows.size:  # the server refuses an empty batch
                        step = client.step(
                            MODEL,
                            split(x_train, rows),
                            y_train[rows],
                            learning_rate=args.lr,
                            expected_batch_size=q * len(y_train),
                            max_norm=args.max_norm,
                            noise_multiplier=args.noise_multiplier,
                            seed=seed,
                            model_version=version,
                        )
                        if version == info.model_version and step.unmoved:
                            tqdm.write(f"warning: the first step moved nothing of {step.unmoved}")
                        version = step.model_version
                    progress.update()
                spent = epsilon(q, args.noise_multiplier, epoch * per_epoch, args.delta)
                test_accuracy = accuracy(client, x_test, y_test, version)
                tqdm.write(f"epoch {epoch}: test accuracy {test_accuracy:.3f}, epsilon {spent:.3f}")
                curve["accuracy"].append(test_accuracy)
                curve["epsilon"].append(spent)
            progress.close()
    if args.plot:
        title = f"DP-LoRA, BERT rank {args.rank}: sigma={args.noise_multiplier}, C={args.max_norm}"
        plot_epochs(args.plot, curve["accuracy"], curve["epsilon"], title)
    print_summary(
        train_examples=len(y_train),
        test_examples=len(y_test),
        majority_share=f"{max(np.mean(y_test), 1 - np.mean(y_test)):.4f}",
        trainable_variables=len(info.variables),
        lora=info.lora,
        sampling_rate=q,
        steps=args.epochs * per_epoch,
        epsilon=spent,
        test_accuracy=f"{test_accuracy:.4f}",
    )


if __name__ == "__main__":
    main()
