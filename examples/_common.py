"""Helpers the examples share: real digits, a local server, predictions, plain SGD, summaries.

Everything here uses only the public client API (`pergrad.client`), as a trainer would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
from scipy.ndimage import zoom
from sklearn.datasets import load_digits

from pergrad.client import GradientClient
from pergrad.client.local import LocalServer

# The built-in models' last layer: the Dense layer that produces the 10 logits.
LAST_LAYER = ["logits/kernel", "logits/bias"]


def digits_28x28() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits shipped with scikit-learn, as float32 [N, 28, 28, 1] in [0, 1]."""
    digits = load_digits()
    images = zoom(digits.images / 16.0, (1, 3.5, 3.5), order=1).clip(0, 1)
    return images[..., None].astype(np.float32), digits.target.astype(np.int32)


def digits_split(
    client: GradientClient, model: str, *, test_size: int = 300, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): shuffled digits, shaped for `model`'s input."""
    x, y = digits_28x28()
    x = x.reshape(len(x), *client.model_info(model).input.shape[1:])
    order = np.random.default_rng(seed).permutation(len(x))
    train, test = order[test_size:], order[:test_size]
    return x[train], y[train], x[test], y[test]


@contextlib.contextmanager
def server(target: str | None, model: str, *flags: str) -> Iterator[str]:
    """Yields `target`, or when it is None starts `pergrad serve` on 127.0.0.1 (a free port,
    just `model`, and `flags`) in a subprocess for the duration and yields its address."""
    if target:
        yield target
        return
    with LocalServer("--model", model, *flags) as local:
        yield local.target


def batches(
    x: np.ndarray, y: np.ndarray, size: int, rng: np.random.Generator | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(x, y) in batches of `size`, in order or shuffled by `rng`."""
    order = rng.permutation(len(x)) if rng is not None else np.arange(len(x))
    for start in range(0, len(x), size):
        yield x[order[start : start + size]], y[order[start : start + size]]


def predict(
    client: GradientClient, model: str, x: np.ndarray, *, version: int = 0, chunk: int = 500
) -> np.ndarray:
    """Predicted classes [N] from the server, which returns losses but not logits.

    With a softmax cross-entropy loss, the loss of label k is -log p(k | x), so the
    argmin over the candidate labels is the argmax of the logits, and exp(-loss) is the
    predictive distribution. We send every example once per class (one batched stream),
    asking for the cheapest reduction (the norms of the last variable) next to the losses.
    """
    info = client.model_info(model)
    classes = info.num_classes
    xs = np.concatenate([x] * classes)
    ys = np.repeat(np.arange(classes, dtype=np.int32), len(x))
    results = client.stream(
        model,
        batches(xs, ys, chunk),
        reduction="norms",
        variables=[info.variables[-1].name],
        model_version=version,
    )
    losses = np.concatenate([r.losses for r in results])
    return losses.reshape(classes, len(x)).argmin(axis=0)


def sgd_epoch(
    client: GradientClient,
    model: str,
    weights: dict[str, np.ndarray],
    version: int,
    data: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    lr: float,
) -> tuple[int, float]:
    """Plain minibatch SGD on the mean per-example gradient (MOMENTS' sum / B), each step
    pinned to the weights it updates; `weights` change in place. Returns (new version,
    mean training loss)."""
    losses = []
    for x, y in data:
        r = client.per_example_gradients(model, x, y, reduction="moments", model_version=version)
        for name, total in r.sum.items():
            weights[name] -= lr * total / len(x)
        version = client.set_weights(model, weights, expected_version=version)
        losses.append(r.losses)
    return version, float(np.concatenate(losses).mean())


def plot_epochs(path: str, accuracy: list[float], epsilon: list[float], title: str) -> None:
    """Test accuracy and the epsilon spent after each epoch, side by side, as an image
    (matplotlib, a dev extra: imported only when a plot is asked for)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    epochs = range(1, len(accuracy) + 1)
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    left.plot(epochs, accuracy, marker="o")
    left.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
    right.plot(epochs, epsilon, marker="o", color="tab:red")
    right.set(xlabel="epoch", ylabel="epsilon spent")
    for axes in (left, right):
        axes.set_xticks(list(epochs))
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def print_summary(**values: object) -> None:
    """The closing `name: value` lines, one a line, that scripts and tests parse."""
    print("summary")
    for name, value in values.items():
        print(f"{name}: {value}")
