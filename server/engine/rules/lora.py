"""LoRA on Dense and EinsumDense: kernel = W + s A B, s = lora_alpha / lora_rank, with
A [*kernel.shape[:-1], r] and B [r, kernel.shape[-1]] (Keras' `enable_lora`).

The layer's output depends on the kernel alone, so the factors' per-example gradients
follow from the kernel's, dK_b (chain rule through K = W + s A B):
    dA_b = s dK_b B^T,    dB_b = s A^T dK_b   (A read as [*, r], dK_b as [*, h]).
Where dK_b is factored, dK_b = sum_t a_bt (x) g_bt with g_bt = [f, h] (Dense: f = 1):
    dA_b = Outer(a, s g B^T),    dB_b = Outer(u, g) over the steps (t, f),
    u_bt = s a_bt A  ([f, r]),
both factored: norms and clipped sums never form the kernel's per-example gradient.
Otherwise dK_b is formed (an EinsumDense whose kernel interleaves its input and output
axes, Gemma's "btd,ndh->btnh") and both products taken from it. W gets its gradient only
where it is still trainable; Keras freezes it.

This module holds the algebra the two layers' rules share; it has no RULE of its own.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer


def _scale(layer: keras.layers.Layer) -> float:
    return layer.lora_alpha / layer.lora_rank


def factored(layer: keras.layers.Layer, kernel: Outer) -> dict[str, Grad]:
    """Both factors' gradients from the kernel's, Outer(a [B, T, P], g [B, T, F h])."""
    a_factor, b_factor = layer.lora_kernel_a, layer.lora_kernel_b
    rank, h = b_factor.shape
    a, g = kernel.a, kernel.g
    b = tf.cast(b_factor, g.dtype)
    steps = tf.reshape(g, [tf.shape(g)[0], -1, h])  # [B, T f, h]
    through_b = tf.matmul(steps, b, transpose_b=True) * _scale(layer)  # [B, T f, r]
    flat_a = tf.reshape(tf.cast(a_factor, a.dtype), [a.shape[-1], -1])  # [P, f r]
    u = tf.reshape(tf.matmul(a, flat_a) * _scale(layer), [tf.shape(a)[0], -1, rank])
    width = g.shape[-1] // h * rank  # f r
    return {
        a_factor.path: Outer(a, tf.reshape(through_b, [tf.shape(g)[0], tf.shape(g)[1], width])),
        b_factor.path: Outer(u, steps),
    }


def formed(layer: keras.layers.Layer, kernel: tf.Tensor) -> dict[str, Grad]:
    """Both factors' gradients from the kernel's, formed: [B, *kernel.shape]."""
    a_factor, b_factor = layer.lora_kernel_a, layer.lora_kernel_b
    rank, h = b_factor.shape
    flat = tf.reshape(kernel, [tf.shape(kernel)[0], -1, h])  # [B, *, h]
    b = tf.cast(b_factor, kernel.dtype)
    a = tf.reshape(tf.cast(a_factor, kernel.dtype), [-1, rank])  # [*, r]
    grad_a = tf.reshape(tf.matmul(flat, b, transpose_b=True), [-1, *a_factor.shape])
    grad_b = tf.einsum("pr,bph->brh", a, flat)
    return {a_factor.path: grad_a * _scale(layer), b_factor.path: grad_b * _scale(layer)}


def kernel_and_factors(layer: keras.layers.Layer, kernel: Grad) -> dict[str, Grad]:
    """The kernel's per-example gradient `kernel` as the layer's variables take it: the
    kernel itself without LoRA, else the factors' (and W's where still trainable)."""
    if not getattr(layer, "lora_enabled", False):
        return {layer.kernel.path: kernel}
    grads = factored(layer, kernel) if isinstance(kernel, Outer) else formed(layer, kernel)
    if layer._kernel.trainable:
        grads[layer._kernel.path] = kernel
    return grads
