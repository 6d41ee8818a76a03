"""DP-SGD against a pergrad server: train a built-in model on real digits with
differential privacy, and report test accuracy and the privacy spent per epoch.

Each step draws a Poisson batch (every training example joins independently with
probability q = batch_size / N) and has the server take the step (`client.step`): it clips
each example's gradient to L2 norm C (--max-norm), sums them, adds Gaussian noise
N(0, (sigma C)^2) from a fresh seed, divides by the *expected* batch size qN and applies
the result with its optimizer (SGD with --momentum on the server this script starts; a
--target server's own `--optimizer` otherwise). Neither the weights nor the sum crosses
the wire (with one server; a client of several replicas sends each the sum once), and
every step pins the version the last one made, so none uses stale weights.

The privacy spent is the epsilon at --delta of the Poisson-subsampled Gaussian mechanism
composed over the steps taken, from Google's dp-accounting (PLD accountant, add-or-remove-
one adjacency). Test accuracy comes from the server's per-example losses (see
`_common.predict`). Without --target the script starts its own local `pergrad serve`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import dp_accounting
import numpy as np
from _common import digits_split, plot_epochs, predict, print_summary, server
from dp_accounting import pld
from tqdm import tqdm

from pergrad.client import GradientClient, StepResult


def epsilon(sampling_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Privacy spent by `steps` Poisson-sampled Gaussian steps, at `delta`."""
    step = dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    # PLD bounds epsilon tighter than RDP; a 1e-3 grid (default 1e-4) takes 0.1 s, not 1 s,
    # and its estimate stays an upper bound.
    accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(step, steps)
    return accountant.get_epsilon(delta)


class DpSgd:
    """DP-SGD steps taken on the server: it clips, sums, noises and applies the update."""

    def __init__(
        self,
        client: GradientClient,
        model: str,
        *,
        max_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        lr: float,
    ) -> None:
        self.client, self.model = client, model
        self.max_norm, self.noise_multiplier = max_norm, noise_multiplier
        self.expected_batch_size, self.lr = expected_batch_size, lr
        self.version = client.model_info(model).model_version

    def step(self, x: np.ndarray, y: np.ndarray, *, seed: int | None = None) -> StepResult:
        """One step on a batch, from the weights of `self.version` (pinned). Without a seed
        the server draws the noise from its operating system's secure random source."""
        done = self.client.step(
            self.model,
            x,
            y,
            learning_rate=self.lr,
            expected_batch_size=self.expected_batch_size,
            max_norm=self.max_norm,
            noise_multiplier=self.noise_multiplier,
            seed=seed,
            model_version=self.version,
        )
        self.version = done.model_version
        return done


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", help="server host:port (default: start a local server)")
    parser.add_argument("--model", default="mnist_mlp", help="mnist_mlp (fastest) or mnist_cnn")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="expected batch size qN")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clipping bound C")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="sigma")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument(
        "--momentum", type=float, default=0.9, help="of the server's SGD, when it starts one"
    )
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--seed", type=int, help="sampling and noise seed, to reproduce a run (default: fresh)"
    )
    parser.add_argument("--plot", help="write test accuracy and epsilon per epoch to this PNG")
    args = parser.parse_args(argv)

    optimizer = f"sgd:momentum={args.momentum}"
    with (
        server(args.target, args.model, "--optimizer", optimizer) as target,
        GradientClient(target) as client,
    ):
        x, y, x_test, y_test = digits_split(client, args.model)
        q = args.batch_size / len(x)
        steps_per_epoch = round(1 / q)
        # Batches and noise must stay secret: whoever knows a step's noise seed can
        # subtract its noise. Without --seed the server draws fresh secure noise.
        rng = np.random.default_rng(args.seed)
        dp = DpSgd(
            client,
            args.model,
            max_norm=args.max_norm,
            noise_multiplier=args.noise_multiplier,
            expected_batch_size=q * len(x),
            lr=args.lr,
        )
        print(
            f"DP-SGD on {len(x)} digits, {args.model} at {target}: q={q:.4f}, "
            f"C={args.max_norm}, sigma={args.noise_multiplier}, {steps_per_epoch} steps/epoch, "
            f"{client.model_info(args.model).optimizer} on the server"
        )
        progress = tqdm(total=args.epochs * steps_per_epoch, unit="step")
        curve: dict[str, list[float]] = {"accuracy": [], "epsilon": []}
        for epoch in range(1, args.epochs + 1):
            for _ in range(steps_per_epoch):
                batch = rng.random(len(x)) < q  # Poisson sampling
                # The server refuses an empty batch; skipping one changes the mechanism
                # only on that event, of probability (1-q)^N < exp(-qN): negligible.
                if batch.any():
                    seed = None if args.seed is None else int(rng.integers(2**63))
                    dp.step(x[batch], y[batch], seed=seed)
                progress.update()
            predicted = predict(client, args.model, x_test, version=dp.version)
            accuracy = float(np.mean(predicted == y_test))
            spent = epsilon(q, args.noise_multiplier, epoch * steps_per_epoch, args.delta)
            tqdm.write(f"epoch {epoch}: test accuracy {accuracy:.3f}, epsilon {spent:.3f}")
            curve["accuracy"].append(accuracy)
            curve["epsilon"].append(spent)
        progress.close()
    if args.plot:
        title = f"DP-SGD, {args.model}: sigma={args.noise_multiplier}, C={args.max_norm}"
        plot_epochs(args.plot, curve["accuracy"], curve["epsilon"], title)
    print_summary(
        model=args.model,
        train_examples=len(x),
        test_examples=len(x_test),
        sampling_rate=q,
        noise_multiplier=args.noise_multiplier,
        steps=args.epochs * steps_per_epoch,
        delta=args.delta,
        epsilon=spent,
        test_accuracy=f"{accuracy:.4f}",
    )


if __name__ == "__main__":
    main()
