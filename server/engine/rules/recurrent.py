"""SimpleRNN, LSTM and GRU (reset_after): a Dense applied per time step to [x_t, h_{t-1}].

Each step's pre-activation is z_t = x_t W + h_{t-1} U + b (GRU: x_t W + b_x and
h_{t-1} U + b_h apart, as it gates them apart). Per example:
    dW_b = sum_t x_bt (x) g_bt,   dU_b = sum_t h_b(t-1) (x) g_bt,   db_b = sum_t g_bt,
with g_bt = dL/dz_bt: the factored form of a Dense on a sequence (`Outer`), so norms and
clipped sums never form W's per-example gradient.

The layer's fused recurrence exposes no z_t, so `forward` runs the same recurrence step
by step (the cell's own weights and activations, masks, go_backwards, return_sequences
and return_state as Keras does them) with a zero "probe" added to each z_t: the backward
pass's gradient with respect to the probe is g. The time axis must have a fixed length.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer
from pergrad.server.engine.rules import Rule


def _applies(layer: keras.layers.Layer) -> str | None:
    name = type(layer).__name__
    if getattr(layer, "stateful", False):
        return f"stateful {name}"
    if isinstance(layer, keras.layers.GRU) and not layer.cell.reset_after:
        return "GRU with reset_after=False"
    shape = (getattr(layer, "_build_shapes_dict", None) or {}).get("sequences_shape")
    if shape is None or len(shape) != 3 or shape[1] is None:
        return f"{name} over a time axis of unknown length"
    return None


def _split_bias(layer: keras.layers.Layer) -> tuple[Any, Any]:
    """(bias added to x W, bias added to h U) of the cell; None where there is none."""
    cell = layer.cell
    if not cell.use_bias:
        return None, None
    if isinstance(layer, keras.layers.GRU):
        return cell.bias[0], cell.bias[1]
    return cell.bias, None


def _step(layer: keras.layers.Layer, zx: tf.Tensor, zh: tf.Tensor, states: list) -> tuple:
    """(new h, new states) of one step from the pre-activations of x and of h."""
    cell, h = layer.cell, states[0]
    if isinstance(layer, keras.layers.LSTM):
        i, f, g, o = tf.split(zx + zh, 4, axis=-1)
        c = cell.recurrent_activation(f) * states[1] + cell.recurrent_activation(
            i
        ) * cell.activation(g)
        h_new = cell.recurrent_activation(o) * cell.activation(c)
        return h_new, [h_new, c]
    if isinstance(layer, keras.layers.GRU):
        x_z, x_r, x_h = tf.split(zx, 3, axis=-1)
        h_z, h_r, h_h = tf.split(zh, 3, axis=-1)
        z = cell.recurrent_activation(x_z + h_z)
        r = cell.recurrent_activation(x_r + h_r)
        h_new = z * h + (1 - z) * cell.activation(x_h + r * h_h)
        return h_new, [h_new]
    h_new = cell.activation(zx + zh)
    return h_new, [h_new]


def _initial_states(layer: keras.layers.Layer, given: Any, zeros: tf.Tensor) -> list[Any]:
    """The states the recurrence starts from: those given, else zeros (an LSTM's two)."""
    if given is not None:
        return list(given) if isinstance(given, list | tuple) else [given]
    return [zeros, zeros] if isinstance(layer, keras.layers.LSTM) else [zeros]


def forward(
    layer: keras.layers.Layer,
    tape: tf.GradientTape,
    sequences: tf.Tensor,
    initial_state: Any = None,
    mask: Any = None,
    training: bool = False,
) -> tuple[Any, Any, Any]:
    cell = layer.cell
    x = tf.cast(sequences, layer.compute_dtype)
    steps = x.shape[1]
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
    if layer.go_backwards:
        x = tf.reverse(x, [1])
        mask = tf.reverse(mask, [1]) if mask is not None else None
    bias_x, bias_h = _split_bias(layer)
    zx = tf.einsum("btd,dg->btg", x, cell.kernel)
    if bias_x is not None:
        zx += bias_x
    probe_x = tf.zeros_like(zx)
    gru = isinstance(layer, keras.layers.GRU)
    probe_h = tf.zeros_like(zx) if gru else probe_x
    tape.watch([probe_x, probe_h] if gru else probe_x)
    zeros = tf.zeros(tf.stack([tf.shape(x)[0], cell.units]), layer.compute_dtype)
    states = _initial_states(layer, initial_state, zeros)
    previous, outputs, output = [], [], zeros
    for t in range(steps):
        previous.append(states[0])
        zh = tf.matmul(states[0], cell.recurrent_kernel)
        if bias_h is not None:
            zh += bias_h
        zh += probe_h[:, t] if gru else 0.0
        step_x = zx[:, t] + probe_x[:, t]
        h_new, new_states = _step(layer, step_x, zh, states)
        if mask is None:
            states, output = new_states, h_new
        else:
            keep = mask[:, t, None]
            states = [tf.where(keep, n, s) for n, s in zip(new_states, states, strict=True)]
            masked = zeros if layer.zero_output_for_mask else output
            output = tf.where(keep, h_new, masked)
        outputs.append(output)
    result = tf.stack(outputs, axis=1) if layer.return_sequences else output
    if layer.return_state:
        result = [result, *states]
    recorded = (x, tf.stack(previous, axis=1))
    return result, recorded, (probe_x, probe_h) if gru else probe_x


def per_example(layer: keras.layers.Layer, inputs: Any, output_grad: Any) -> dict[str, Grad]:
    x, h_previous = inputs
    cell = layer.cell
    g_x, g_h = output_grad if isinstance(layer, keras.layers.GRU) else (output_grad, output_grad)
    grads: dict[str, Grad] = {
        cell.kernel.path: Outer(x, g_x),
        cell.recurrent_kernel.path: Outer(h_previous, g_h),
    }
    if cell.use_bias:
        summed = tf.reduce_sum(g_x, axis=1)
        if isinstance(layer, keras.layers.GRU):
            summed = tf.stack([summed, tf.reduce_sum(g_h, axis=1)], axis=1)
        grads[cell.bias.path] = summed
    return grads


RULE = Rule(per_example, _applies, forward)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU)
