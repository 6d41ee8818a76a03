"""`make demo`: start a server on the built-in mnist_cnn, ask it for per-example gradients
of real handwritten digits (scikit-learn's bundled set, upsampled to 28x28), print them.
"""

from __future__ import annotations

import time

from _common import digits_28x28, server

from pergrad.client import GradientClient


def main() -> None:
    x, y = digits_28x28()
    print(f"data: {len(x)} scikit-learn digits upsampled to 28x28")
    with server(None, "mnist_cnn") as target, GradientClient(target) as client:
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
    print("server stopped")


if __name__ == "__main__":
    main()
