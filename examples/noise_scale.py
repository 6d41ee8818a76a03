"""The gradient noise scale during training, from a pergrad server's MOMENTS.

The simple noise scale of McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", B_simple = tr(Sigma) / |G|^2, where G is the expected per-example gradient and
Sigma its covariance, predicts the critical batch size: batches much smaller than
B_simple waste steps, much larger ones waste examples.

Before training and after each epoch of plain SGD, the weights are held fixed (pinned by
`model_version`) and one `stream` over the N training examples with reduction "moments"
returns S = sum_i g_i and Q = sum_i g_i^2 per parameter. Treating the examples as i.i.d.
draws, the unbiased estimators are

    tr(Sigma)^ = sum_p (Q_p - S_p^2 / N) / (N - 1)   (the per-parameter sample variances)
    |G|^2^     = |S / N|^2 - tr(Sigma)^ / N          (as E|S/N|^2 = |G|^2 + tr(Sigma) / N)

and B_simple^ is their ratio (consistent, not itself unbiased). Without --target the
script starts its own local `pergrad serve`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
from _common import batches, digits_split, print_summary, server, sgd_epoch

from pergrad.client import GradientClient


def noise_scale(
    client: GradientClient, model: str, x: np.ndarray, y: np.ndarray, *, version: int
) -> tuple[float, float, float, float]:
    """(mean loss, |G|^2, tr(Sigma), B_simple) at the weights of `version`."""
    total: dict[str, np.ndarray] = {}
    squares: dict[str, np.ndarray] = {}
    losses = []
    for r in client.stream(model, batches(x, y, 256), reduction="moments", model_version=version):
        for name in r.sum:
            total[name] = total.get(name, 0.0) + r.sum[name].astype(np.float64)
            squares[name] = squares.get(name, 0.0) + r.sum_squares[name].astype(np.float64)
        losses.append(r.losses)
    n = len(x)
    trace = sum(float((squares[k] - total[k] ** 2 / n).sum()) for k in total) / (n - 1)
    gradient = sum(float(np.square(total[k] / n).sum()) for k in total) - trace / n
    # |G|^2^ <= 0: the gradient is lost in its noise, beyond what N examples resolve.
    scale = trace / gradient if gradient > 0 else float("inf")
    return float(np.concatenate(losses).mean()), gradient, trace, scale


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="server host:port (default: start a local server)")
    parser.add_argument("--model", default="mnist_mlp", help="mnist_mlp (fastest) or mnist_cnn")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    with server(args.target, args.model) as target, GradientClient(target) as client:
        x, y, _, _ = digits_split(client, args.model)
        rng = np.random.default_rng(args.seed)
        version, weights = client.get_weights(args.model)
        print(f"{len(x)} training digits, {args.model} at {target}, SGD batch {args.batch_size}")
        print(f"{'epoch':>5}  {'loss':>6}  {'|G|^2':>9}  {'tr(Sigma)':>9}  {'B_simple':>8}")
        scales = []
        for epoch in range(args.epochs + 1):
            if epoch:
                data = batches(x, y, args.batch_size, rng)
                version, _ = sgd_epoch(client, args.model, weights, version, data, lr=args.lr)
            loss, gradient, trace, scale = noise_scale(client, args.model, x, y, version=version)
            scales.append(scale)
            print(f"{epoch:5d}  {loss:6.3f}  {gradient:9.4f}  {trace:9.3f}  {scale:8.1f}")
    print(
        f"B_simple went from {scales[0]:.0f} to {scales[-1]:.0f}; it typically grows as the "
        "loss falls (the gradient shrinks faster than its noise), so larger batches pay off "
        "later in training"
    )
    print_summary(
        model=args.model,
        train_examples=len(x),
        epochs=args.epochs,
        initial_noise_scale=f"{scales[0]:.2f}",
        final_noise_scale=f"{scales[-1]:.2f}",
    )


if __name__ == "__main__":
    main()
