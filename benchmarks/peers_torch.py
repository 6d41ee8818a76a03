"""The PyTorch side of `benchmarks/peers.py`: torch.func and Opacus on pergrad's built-in
models, rebuilt in PyTorch with the same weights and batch.

Runs in its own virtualenv (.venv-peers: torch 2.13.0 CPU, opacus, numpy), never in
make test's: `peers.py` starts it, one fresh process per (tool, workload, quantity) and
round. Each process loads the weights and batch that `peers.py` saved from the Keras
model, checks that its per-example losses match Keras's before timing anything, then
times one method (warm-up calls first, then the median of --calls calls, at least 3 and
no more once they pass 5 s), prints one JSON line, and saves its last result's losses,
per-example norms and clipped sum to an .npz for peers.py to compare across tools.

    python benchmarks/peers_torch.py TOOL WORKLOAD QUANTITY DATA.npz OUT.npz \
        [--warmup 2] [--calls 5] [--threads 2]

TOOL: torch_func | opacus_hooks | opacus_ghost. QUANTITY: full | norms | clipped_sum
(opacus_ghost has no full per-example gradients: it never forms them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MAX_NORM = 1.0
LOSS_TOLERANCE = 1e-4
TOOLS = ["torch_func", "opacus_hooks", "opacus_ghost"]
QUANTITIES = ["full", "norms", "clipped_sum"]
BUDGET_S = 5.0  # timed calls stop past this, once there are MIN_CALLS
MIN_CALLS = 3


def enough(times: list[float]) -> bool:
    return len(times) >= MIN_CALLS and sum(times) > BUDGET_S


# --- The built-in models (server/models/builtin.py), in PyTorch ---------------------------


def _dense(weights: dict[str, np.ndarray], name: str) -> nn.Linear:
    """keras Dense `name` (kernel [in, out]) as nn.Linear (weight [out, in])."""
    kernel = weights[f"{name}/kernel"]
    layer = nn.Linear(kernel.shape[0], kernel.shape[1])
    _load(layer.weight, kernel.T)
    _load(layer.bias, weights[f"{name}/bias"])
    return layer


def _conv(weights: dict[str, np.ndarray], name: str, *, stride: int, padding: int) -> nn.Conv2d:
    """keras Conv2D (kernel [kh, kw, in, out], channels last) as nn.Conv2d (OIHW)."""
    kernel = weights[f"{name}/kernel"]
    kh, kw, c_in, c_out = kernel.shape
    layer = nn.Conv2d(c_in, c_out, (kh, kw), stride=stride, padding=padding)
    _load(layer.weight, kernel.transpose(3, 2, 0, 1))
    _load(layer.bias, weights[f"{name}/bias"])
    return layer


def _load(parameter: torch.Tensor, value: np.ndarray) -> None:
    with torch.no_grad():
        parameter.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))


class MnistMLP(nn.Module):
    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.hidden = _dense(w, "hidden")
        self.logits = _dense(w, "logits")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(F.relu(self.hidden(x)))


class MnistCNN(nn.Module):
    """Input NCHW [B, 1, 28, 28]. Keras 'same' padding of an 8x8 kernel at stride 2 on 28
    pads 3 on each side (6 in all, split evenly), so padding=3 gives the same 14x14."""

    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.conv1 = _conv(w, "conv1", stride=2, padding=3)
        self.pool1 = nn.MaxPool2d(2, stride=1)
        self.conv2 = _conv(w, "conv2", stride=2, padding=0)
        self.pool2 = nn.MaxPool2d(2, stride=1)
        self.hidden = _dense(w, "hidden")
        self.logits = _dense(w, "logits")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool1(F.relu(self.conv1(x)))
        h = self.pool2(F.relu(self.conv2(h)))
        h = h.permute(0, 2, 3, 1).flatten(1)  # Keras flattens NHWC
        return self.logits(F.relu(self.hidden(h)))


class WideMLP(nn.Module):
    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.hidden1 = _dense(w, "hidden1")
        self.hidden2 = _dense(w, "hidden2")
        self.logits = _dense(w, "logits")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(F.relu(self.hidden2(F.relu(self.hidden1(x)))))


class Positions(nn.Module):
    """pergrad's PositionEmbedding: a learned [T, D] added to every sequence."""

    def __init__(self, positions: np.ndarray) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.empty(positions.shape))
        _load(self.positions, positions)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.positions


class Attention(nn.Module):
    """keras MultiHeadAttention(4, key_dim 16) self-attention. Its EinsumDense kernels
    (query/key/value [D, H, K], output [H, K, D]) are plain matrices once heads and key
    dims are merged (index h*K + k), so each becomes an nn.Linear, which Opacus supports
    (hooks and ghost norms) as it is."""

    def __init__(self, w: dict[str, np.ndarray], heads: int = 4, key_dim: int = 16) -> None:
        super().__init__()
        self.heads, self.key_dim = heads, key_dim
        width = heads * key_dim
        for part in ("query", "key", "value"):
            kernel = w[f"attention/{part}/kernel"]
            layer = nn.Linear(kernel.shape[0], width)
            _load(layer.weight, kernel.reshape(kernel.shape[0], width).T)
            _load(layer.bias, w[f"attention/{part}/bias"].reshape(width))
            setattr(self, part, layer)
        kernel = w["attention/attention_output/kernel"]
        self.attention_output = nn.Linear(width, kernel.shape[-1])
        _load(self.attention_output.weight, kernel.reshape(width, kernel.shape[-1]).T)
        _load(self.attention_output.bias, w["attention/attention_output/bias"])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, H*K] -> [B, H, T, K]
            return x.view(b, t, self.heads, self.key_dim).transpose(1, 2)

        # Keras scales the projected query (bias included) by 1/sqrt(key_dim).
        q = split(self.query(h)) * (1.0 / self.key_dim**0.5)
        k, v = split(self.key(h)), split(self.value(h))
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, self.heads * self.key_dim)
        return self.attention_output(out)


class TransformerBlock(nn.Module):
    """Embedding + positions -> pre-LN attention block (LayerNorm eps 1e-3 as Keras's
    default) -> MLP with exact (erf) GELU, as keras.activations.gelu's default
    approximate=False -> mean over tokens -> logits."""

    def __init__(self, w: dict[str, np.ndarray]) -> None:
        super().__init__()
        embeddings = w["embedding/embeddings"]
        self.embedding = nn.Embedding(*embeddings.shape)
        _load(self.embedding.weight, embeddings)
        self.positions = Positions(w["positions/positions"])
        self.ln1 = self._layer_norm(w, "ln1")
        self.attention = Attention(w)
        self.ln2 = self._layer_norm(w, "ln2")
        self.mlp_up = _dense(w, "mlp_up")
        self.mlp_down = _dense(w, "mlp_down")
        self.logits = _dense(w, "logits")

    @staticmethod
    def _layer_norm(w: dict[str, np.ndarray], name: str) -> nn.LayerNorm:
        gamma = w[f"{name}/gamma"]
        layer = nn.LayerNorm(gamma.shape[0], eps=1e-3)
        _load(layer.weight, gamma)
        _load(layer.bias, w[f"{name}/beta"])
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.positions(self.embedding(tokens))
        h = h + self.attention(self.ln1(h))
        h = h + self.mlp_down(F.gelu(self.mlp_up(self.ln2(h))))
        return self.logits(h.mean(dim=1))


MODELS: dict[str, Callable[[dict[str, np.ndarray]], nn.Module]] = {
    "mnist_mlp": MnistMLP,
    "mnist_cnn": MnistCNN,
    "wide_mlp": WideMLP,
    "transformer_block": TransformerBlock,
}


def load(workload: str, path: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, np.ndarray]:
    """The model with the saved Keras weights, the batch in PyTorch's layout, and the
    per-example losses Keras computed on it."""
    data = np.load(path)
    weights = {k[len("w:") :]: data[k] for k in data.files if k.startswith("w:")}
    model = MODELS[workload](weights)
    x = torch.from_numpy(data["x"])
    if workload == "mnist_cnn":
        x = x.permute(0, 3, 1, 2)  # NHWC -> NCHW, once, outside the timed calls
    # A fresh tensor in PyTorch's default (NCHW-contiguous) strides: with one channel,
    # the permuted view's strides also read as channels_last, which CPU convolutions
    # then propagate, and Opacus 1.6's Conv2d grad sampler (unfold2d's as_strided)
    # computes wrong per-example gradients from channels_last activations.
    x = torch.empty(x.shape, dtype=torch.int64 if x.dtype == torch.int32 else x.dtype).copy_(x)
    y = torch.from_numpy(data["y"].astype(np.int64))
    names = {name for name, _ in model.named_parameters()}
    if len(names) != len(weights):
        raise SystemExit(f"{workload}: {len(names)} torch parameters, {len(weights)} Keras")
    return model, x, y, data["losses"]


def keras_shapes(path: str) -> dict[str, tuple[int, ...]]:
    data = np.load(path)
    return {k[len("w:") :]: data[k].shape for k in data.files if k.startswith("w:")}


# --- The methods: each computes a whole batch's per-example quantity ---------------------


def per_example_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def norms_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-example L2 norms over all parameters of [B, *shape] gradients."""
    per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in grads]
    return torch.stack(per_param, dim=1).norm(2, dim=1)


def clipped_sum_of(grads: list[torch.Tensor], norms: torch.Tensor) -> list[torch.Tensor]:
    scale = (MAX_NORM / norms.clamp_min(1e-30)).clamp(max=1.0)
    return [torch.einsum("b,b...->...", scale, g) for g in grads]


Result = dict[str, object]  # losses, and full grads / norms / clipped_sum as computed


def torch_func_method(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, quantity: str
) -> Callable[[], Result]:
    """vmap(grad_and_value) of one example's loss; norms and clipping from the full tensors."""
    from torch.func import functional_call, grad_and_value, vmap

    params = {name: p.detach() for name, p in model.named_parameters()}
    names = list(params)

    def one_loss(params, xb, yb):
        logits = functional_call(model, params, (xb.unsqueeze(0),))
        return F.cross_entropy(logits, yb.unsqueeze(0))

    per_example = vmap(grad_and_value(one_loss), in_dims=(None, 0, 0))

    def run() -> Result:
        grads, losses = per_example(params, x, y)
        full = [grads[n] for n in names]
        if quantity == "full":
            return {"losses": losses, "full": full}
        norms = norms_of(full)
        if quantity == "norms":
            return {"losses": losses, "norms": norms}
        return {"losses": losses, "norms": norms, "clipped_sum": clipped_sum_of(full, norms)}

    return run


def _register_positions() -> None:
    """Opacus needs a grad sampler for a custom layer (else it falls back to functorch per
    layer): PositionEmbedding's per-example gradient is its output's backprop."""
    from opacus.grad_sample import register_grad_sampler

    @register_grad_sampler(Positions)
    def _positions_grad_sample(layer, activations, backprops):
        return {layer.positions: backprops}


def opacus_hooks_method(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, quantity: str
) -> Callable[[], Result]:
    """GradSampleModule: one forward and backward fill p.grad_sample [B, *shape]; the
    clipped sum is Opacus's own DPOptimizer.clip_and_accumulate (noise 0)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    _register_positions()
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    params = [p for p in gsm.parameters() if p.requires_grad]
    optimizer = DPOptimizer(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=MAX_NORM,
        expected_batch_size=len(y),
        loss_reduction="sum",
    )

    def run() -> Result:
        optimizer.zero_grad(set_to_none=True)
        losses = per_example_losses(gsm, x, y)
        losses.sum().backward()
        full = [p.grad_sample for p in params]
        if quantity == "full":
            return {"losses": losses.detach(), "full": full}
        if quantity == "norms":
            return {"losses": losses.detach(), "norms": norms_of(full)}
        optimizer.clip_and_accumulate()  # computes the norms itself; saved from `full`
        return {
            "losses": losses.detach(),
            "full": full,
            "clipped_sum": [p.summed_grad for p in params],
        }

    return run


def opacus_ghost_method(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, quantity: str
) -> Callable[[], Result]:
    """GradSampleModuleFastGradientClipping with ghost clipping: the first backward's hooks
    give per-example norms without per-example gradients (ghost norms for Linear and
    Embedding, grad samples for the rest); for the clipped sum, DPLossFastGradientClipping
    adds the second backward of sum(coef * loss), which leaves the clipped sum in p.grad."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    if quantity == "full":
        raise SystemExit("opacus_ghost never forms full per-example gradients")
    _register_positions()
    gsm = GradSampleModuleFastGradientClipping(
        model,
        batch_first=True,
        loss_reduction="sum",
        max_grad_norm=MAX_NORM,
        use_ghost_clipping=True,
    )
    params = [p for p in gsm.parameters() if p.requires_grad]
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=MAX_NORM,
        expected_batch_size=len(y),
        loss_reduction="sum",
    )
    criterion = DPLossFastGradientClipping(
        gsm, optimizer, nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    )

    def run() -> Result:
        optimizer.zero_grad(set_to_none=True)
        if quantity == "norms":
            losses = per_example_losses(gsm, x, y)
            losses.sum().backward()
            return {"losses": losses.detach(), "norms": gsm.get_norm_sample()}
        loss = criterion(gsm(x), y)
        loss.backward()
        return {
            "losses": loss.loss_per_sample.detach(),
            "norms": gsm.per_sample_gradient_norms,
            "clipped_sum": [p.grad for p in params],
        }

    return run


METHODS = {
    "torch_func": torch_func_method,
    "opacus_hooks": opacus_hooks_method,
    "opacus_ghost": opacus_ghost_method,
}


KERAS_NAMES = {
    nn.Linear: {"weight": "kernel", "bias": "bias"},
    nn.Conv2d: {"weight": "kernel", "bias": "bias"},
    nn.LayerNorm: {"weight": "gamma", "bias": "beta"},
    nn.Embedding: {"weight": "embeddings"},
    Positions: {"positions": "positions"},
}


def keras_layout(
    model: nn.Module, values: list[torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """Values shaped like the model's parameters (in named_parameters order), back in
    Keras's variable paths and layouts (Dense kernels [in, out], Conv2D HWIO, the
    attention's EinsumDense kernels [D, H, K] / [H, K, D])."""
    by_name = dict(zip([n for n, _ in model.named_parameters()], values, strict=True))
    out = {}
    for module_name, module in model.named_modules():
        for attr, keras_attr in KERAS_NAMES.get(type(module), {}).items():
            value = by_name[f"{module_name}.{attr}"].detach()
            if isinstance(module, nn.Conv2d) and attr == "weight":
                value = value.permute(2, 3, 1, 0)
            elif isinstance(module, nn.Linear) and attr == "weight":
                value = value.T
            path = f"{module_name.replace('.', '/')}/{keras_attr}"
            out[path] = value.reshape(shapes[path]).numpy()
    if set(out) != set(shapes):
        raise SystemExit(f"no Keras variable for {sorted(set(shapes) ^ set(out))}")
    return out


def to_saved(
    model: nn.Module, result: Result, shapes: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """What peers.py compares: losses, per-example norms (from the full tensors when the
    method gives those), and the clipped sum by Keras variable path ("sum:PATH")."""
    saved = {"losses": result["losses"].detach().numpy()}
    if "full" in result:
        saved["norms"] = norms_of([g.detach() for g in result["full"]]).numpy()
    else:
        saved["norms"] = result["norms"].detach().numpy()
    if "clipped_sum" in result:
        summed = keras_layout(model, result["clipped_sum"], shapes)
        saved.update({f"sum:{path}": value for path, value in summed.items()})
    return saved


def _opacus_version() -> str:
    from importlib.metadata import version

    return version("opacus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tool", choices=TOOLS)
    parser.add_argument("workload", choices=sorted(MODELS))
    parser.add_argument("quantity", choices=QUANTITIES)
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, x, y, keras_losses = load(args.workload, args.data)
    shapes = keras_shapes(args.data)
    model.train()  # Opacus's hooks only record in training mode; no dropout anywhere

    with torch.no_grad():
        losses = per_example_losses(model, x, y).numpy()
    gap = float(np.max(np.abs(losses - keras_losses)))
    if not np.allclose(losses, keras_losses, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE):
        print(f"{args.workload}: PyTorch losses differ from Keras's by {gap:.3g}", file=sys.stderr)
        raise SystemExit(3)

    run = METHODS[args.tool](model, x, y, args.quantity)
    for _ in range(args.warmup):
        result = run()
    times = []
    while len(times) < args.calls and not enough(times):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    np.savez(args.out, **to_saved(model, result, shapes))
    print(
        json.dumps(
            {
                "median_s": statistics.median(times),
                "times_s": times,
                "keras_loss_gap": gap,
                "torch": torch.__version__,
                "opacus": _opacus_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
