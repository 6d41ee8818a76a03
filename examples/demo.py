"""`make demo`: start a server on the built-in mnist_cnn, ask it for per-example gradients
of real handwritten digits (scikit-learn's bundled set, upsampled to 28x28), print them.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import numpy as np
from scipy.ndimage import zoom
from sklearn.datasets import load_digits

from pergrad.client import GradientClient


def digits_28x28() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits shipped with scikit-learn, as float32 [N, 28, 28, 1] in [0, 1]."""
    digits = load_digits()
    images = zoom(digits.images / 16.0, (1, 3.5, 3.5), order=1).clip(0, 1)
    return images[..., None].astype(np.float32), digits.target.astype(np.int32)


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pergrad.client.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--model",
            model,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stderr:
        if match := re.search(r"pergrad ready on (\S+:\d+)", line):
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, match.group(1)
    raise RuntimeError(f"server exited with {process.wait()} before it was ready")


def main() -> None:
    x, y = digits_28x28()
    print(f"data: {len(x)} scikit-learn digits upsampled to 28x28")
    process, target = start_server("mnist_cnn")
    try:
        with GradientClient(target) as client:
            info = client.model_info("mnist_cnn")
            print(
                f"server {target}: {info.name} v{info.model_version}, "
                f"{info.num_parameters:,} parameters, loss {info.loss}"
            )
            result = client.per_example_gradients("mnist_cnn", x[:12], y[:12])
            norms = result.gradient_norms()
            print("\nexample  label  loss     gradient L2 norm")
            for i in range(result.batch_size):
                print(f"{i:7d}  {y[i]:5d}  {result.losses[i]:.4f}   {norms[i]:.4f}")
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in result.gradients.items())
            print(f"\nper-example gradient tensors: {shapes}")
            start = time.perf_counter()
            batches = ((x[i : i + 256], y[i : i + 256]) for i in range(0, len(x), 256))
            count = sum(r.batch_size for r in client.stream("mnist_cnn", batches))
            elapsed = time.perf_counter() - start
            print(
                f"streamed all {count} digits in batches of 256: {elapsed:.2f} s "
                f"({count / elapsed:,.0f} examples/s with full per-example gradients)"
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
    print("server stopped")


if __name__ == "__main__":
    main()
