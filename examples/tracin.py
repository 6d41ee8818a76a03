"""TracIn data valuation against a pergrad server: which training examples most helped or
hurt a prediction, and which look mislabeled.

A short plain-SGD run on real digits, with a fraction of the training labels deliberately
flipped to a wrong class, saves a checkpoint after every epoch. TracIn (Pruthi et al.
2020) then sums over those checkpoints, restored with `set_weights`:

    influence(train i, test t) = sum_c lr_c <g_i(w_c), g_t(w_c)>   (reduction "dot")
    self-influence(train i)    = sum_c lr_c ||g_i(w_c)||^2          (reduction "norms")

Influence on a few test examples is computed over all layers and over the last layer only
(`variables=`), a common cheaper proxy; the script prints the top proponents (positive:
training on them lowered the test loss) and opponents, and how many flipped labels rank
in the top of self-influence (the base rate is the flip fraction). Without --target the
script starts its own local `pergrad serve`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
from _common import LAST_LAYER, batches, digits_split, print_summary, server, sgd_epoch
from scipy.stats import spearmanr

from pergrad.client import GradientClient


def flip_labels(
    y: np.ndarray, fraction: float, classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(labels with `fraction` of them moved to another random class, which were flipped)."""
    flipped = np.zeros(len(y), bool)
    flipped[rng.choice(len(y), round(fraction * len(y)), replace=False)] = True
    noisy = y.copy()
    noisy[flipped] = (y[flipped] + rng.integers(1, classes, flipped.sum())) % classes
    return noisy, flipped


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="server host:port (default: start a local server)")
    parser.add_argument("--model", default="mnist_mlp", help="mnist_mlp (fastest) or mnist_cnn")
    parser.add_argument("--epochs", type=int, default=3, help="one checkpoint after each")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--flip", type=float, default=0.05, help="fraction of labels flipped")
    parser.add_argument("--tests", type=int, default=3, help="test examples to explain (<= 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.flip < 1 or not 1 <= args.tests <= 10:
        parser.error("--flip must be in (0, 1) and --tests in [1, 10]")

    with server(args.target, args.model) as target, GradientClient(target) as client:
        x, y_true, x_test, y_test = digits_split(client, args.model)
        rng = np.random.default_rng(args.seed)
        classes = client.model_info(args.model).num_classes
        y, flipped = flip_labels(y_true, args.flip, classes, rng)
        print(f"{len(x)} training digits, {flipped.sum()} labels flipped; {args.model} at {target}")
        # The first test example of each of the classes 0, 1, ... to explain.
        explained = [int(np.flatnonzero(y_test == c)[0]) for c in range(args.tests)]

        version, weights = client.get_weights(args.model)
        checkpoints = []
        for epoch in range(1, args.epochs + 1):
            data = batches(x, y, args.batch_size, rng)
            version, loss = sgd_epoch(client, args.model, weights, version, data, lr=args.lr)
            checkpoints.append({name: w.copy() for name, w in weights.items()})
            print(f"epoch {epoch}: mean training loss {loss:.3f}, checkpoint saved")

        layers = {"all layers": None, "last layer": LAST_LAYER}
        self_influence = {name: np.zeros(len(x)) for name in layers}
        influence = {name: np.zeros((len(x), args.tests)) for name in layers}
        for checkpoint in checkpoints:
            version = client.set_weights(args.model, checkpoint)
            pinned = {"model_version": version}
            norms = list(client.stream(args.model, batches(x, y, 256), reduction="norms", **pinned))
            self_influence["all layers"] += args.lr * np.concatenate([r.norms for r in norms]) ** 2
            self_influence["last layer"] += args.lr * sum(
                np.concatenate([r.variable_norms[name] for r in norms]) ** 2 for name in LAST_LAYER
            )
            tests = client.per_example_gradients(
                args.model, x_test[explained], y_test[explained], **pinned
            ).gradients
            for name, variables in layers.items():
                reference = {v: g for v, g in tests.items() if variables is None or v in variables}
                results = client.stream(
                    args.model,
                    batches(x, y, 256),
                    reduction="dot",
                    reference=reference,
                    variables=variables,
                    **pinned,
                )
                influence[name] += args.lr * np.concatenate([r.dots for r in results])

    def describe(i: int) -> str:
        return f"#{i} ({y[i]}, really {y_true[i]})" if flipped[i] else f"#{i} ({y[i]})"

    print("\ninfluence over all layers on test examples; training examples as #index (label)")
    print("(mislabeled examples have large gradients, so they crowd both ends of a ranking)")
    for t, index in enumerate(explained):
        order = np.argsort(-influence["all layers"][:, t])
        print(f"test #{index} (label {y_test[index]})")
        print("  proponents:", ", ".join(describe(i) for i in order[:5]))
        print("  opponents: ", ", ".join(describe(i) for i in order[::-1][:5]))
    agreement = np.mean(
        [
            spearmanr(influence["all layers"][:, t], influence["last layer"][:, t])[0]
            for t in range(args.tests)
        ]
    )
    top = max(1, round(args.flip * len(x)))
    recall = {
        name: flipped[np.argsort(-scores)[:top]].sum() / flipped.sum()
        for name, scores in self_influence.items()
    }
    print(f"last layer vs all layers: Spearman rank correlation {agreement:.2f} (mean)")
    print(f"\nflipped labels among the top {top} by self-influence:")
    for name, value in recall.items():
        print(f"  {name}: recall {value:.2f} (chance: {top / len(x):.2f})")
    print_summary(
        model=args.model,
        train_examples=len(x),
        flipped=int(flipped.sum()),
        top=top,
        base_rate=f"{top / len(x):.4f}",
        self_influence_recall=f"{recall['all layers']:.4f}",
        last_layer_self_influence_recall=f"{recall['last layer']:.4f}",
        last_layer_vs_all_layers_spearman=f"{agreement:.4f}",
    )


if __name__ == "__main__":
    main()
