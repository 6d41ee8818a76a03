"""The engine on a zoo of model families (tests/zoo.py) against the Keras-only oracle.

Small models: full per-example gradients and losses. Every model: per-example norms
(whole and per variable) and a clipped sum whose bound lies between the smallest and the
largest norm, against the oracle's gradients clipped in float64. keras.applications
models are too large for full gradients of a batch; they get the norms and the clipped
sum only, against the oracle run in float64 (`oracle.in_float64`), within the bound the
README states: twice the float32 loop's own error where that exceeds the contract
(`tests.helpers.float64_tolerances`). Each family's
`ruled` flag is held to the route the engine's plan takes.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.engine import Engine
from pergrad.server.engine.engine import UNREACHED
from pergrad.server.errors import InvalidArgument
from tests import oracle, zoo_keras_hub
from tests.helpers import RELATIVE_TOLERANCE, assert_close, float64_tolerances
from tests.zoo import FAMILIES, Family

ROOT = Path(__file__).resolve().parents[3]


@functools.cache
def _built(name: str) -> tuple[Family, keras.Model, Any, Engine]:
    """A family's model, loss and engine, built once per test process: the tests below
    only compute with them, and a model's engine traces for seconds."""
    family = FAMILIES[name]
    model, loss = family.build()
    compiled = getattr(model, "loss", None)  # the engine takes the compiled loss if any
    engine = Engine(
        model, loss=None if compiled is not None else loss, jit_compile=family.jit_compile
    )
    return family, model, loss, engine


def _check_route(engine: Engine, family: Family) -> None:
    """The family's `ruled` says which route the engine's plan takes: True, a closed-form
    rule for every variable; False, the generic route for some (a family whose layers
    gain rules changes its flag)."""
    if family.ruled:
        assert engine.plan.fallback == (), engine.plan.describe()
    else:
        assert engine.plan.fallback, engine.plan.describe()


Grads = dict[str, np.ndarray]


def _reduced(grads: Grads, max_norm: float) -> dict[str, Grads]:
    """What the engine's norms and clipped sum return, from per-example gradients."""
    return {
        "norms": {"norms": oracle.per_example_norms(grads)},
        "variable_norms": {name: oracle.per_example_norms({name: g}) for name, g in grads.items()},
        "clipped_sum": oracle.clipped_sum(grads, max_norm),
    }


def _check_reductions(
    engine: Engine, x: Any, y: np.ndarray, grads: Grads, float32_grads: Grads | None = None
) -> np.ndarray:
    """Norms and a clipped sum against the oracle's `grads`: within the contract, or, for
    `grads` from the float64 loop, within the bound the float32 loop's own error sets;
    returns the per-example losses."""
    norms = oracle.per_example_norms(grads)
    assert norms.min() < norms.max()
    max_norm = float(np.sqrt(norms.min() * norms.max()))  # strictly between the two
    expected = _reduced(grads, max_norm)
    bounds = dict.fromkeys(expected, RELATIVE_TOLERANCE)
    if float32_grads is not None:
        loop = _reduced(float32_grads, max_norm)
        bounds = {key: float64_tolerances(loop[key], expected[key]) for key in expected}

    result = engine.per_example_gradients(x, y, reduction="norms")
    assert_close({"norms": result.norms}, expected["norms"], bounds["norms"])
    assert_close(result.variable_norms, expected["variable_norms"], bounds["variable_norms"])
    clipped = engine.per_example_gradients(x, y, reduction="clipped_sum", max_norm=max_norm)
    assert clipped.num_clipped == int(np.sum(norms > max_norm))
    assert_close({"norms": clipped.norms}, expected["norms"], bounds["norms"])
    assert_close(clipped.clipped_sum, expected["clipped_sum"], bounds["clipped_sum"])
    return result.losses


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_keras_oracle(name: str) -> None:
    family, model, loss, engine = _built(name)
    _check_route(engine, family)
    x, y = family.batch(model, family.size)
    losses, grads = oracle.per_example(model, loss, x, y)
    assert set(grads) == {v.name for v in engine.variables}
    if family.full:
        result = engine.per_example_gradients(x, y)
        assert_close({"losses": result.losses}, {"losses": losses})
        assert_close(result.gradients, grads)
        in_pass_losses = _check_reductions(engine, x, y, grads)
    else:  # the deep keras.applications families: against the float64 loop
        twin = oracle.in_float64(family.build, model)
        exact = oracle.per_example(twin, loss, np.asarray(x, np.float64), y)[1]
        in_pass_losses = _check_reductions(engine, x, y, exact, float32_grads=grads)
    assert_close({"losses": in_pass_losses}, {"losses": losses})


def test_variables_the_loss_never_reaches_are_named_and_get_zeros() -> None:
    """A classifier on BERT's sequence output never reaches its pooler: the engine names
    those variables' route (ModelInfo.routes), and the oracle agrees their gradients are
    zeros (test_family_matches_keras_oracle)."""
    _, _, _, engine = _built("bert_classifier")
    unreached = {
        v.name for v, r in zip(engine.variables, engine.routes, strict=True) if r == UNREACHED
    }
    assert unreached == {"pooled_dense/kernel", "pooled_dense/bias"}


KERAS_HUB = sorted(n for n, f in FAMILIES.items() if f.build.__module__ == zoo_keras_hub.__name__)


@pytest.mark.parametrize("name", KERAS_HUB)
@pytest.mark.parametrize("bad", [zoo_keras_hub.VOCABULARY, -1])
def test_token_ids_outside_the_vocabulary_are_refused_naming_them(name: str, bad: int) -> None:
    """The token table sits in a backbone nested under the head (an id past it would be
    clamped to another row under XLA, or wrap without it): refused, naming the example."""
    family, model, _, engine = _built(name)
    x, y = family.batch(model, 3)
    x["token_ids"][1, 2] = bad
    refused = r"examples \[1\] (hold|give embedding 'token_embedding') ids outside \[0, 50\)"
    with pytest.raises(InvalidArgument, match=refused):
        engine.per_example_gradients(x, y, reduction="norms")


def test_list_and_dict_inputs_give_the_same_result() -> None:
    """The two-input transformer takes its inputs as a list in model order or as a dict
    by input name; the dict-input model as a dict or as a list in Keras' order."""
    family, model, _, engine = _built("transformer_encoder")
    (ids, mask), y = family.batch(model, 3)
    by_list = engine.per_example_gradients([ids, mask], y)
    by_name = engine.per_example_gradients({"ids": ids, "mask": mask}, y)
    assert_close(by_name.gradients, by_list.gradients)

    family, model, _, engine = _built("dict_features")
    x, y = family.batch(model, 3)
    by_name = engine.per_example_gradients(x, y)
    by_list = engine.per_example_gradients([x["category"], x["numeric"]], y)
    assert_close(by_list.gradients, by_name.gradients)


def test_float64_and_int64_batches_are_cast() -> None:
    """numpy's default dtypes reach the model as float32 and int32 and give the
    oracle's result on the float32 batch."""
    family, model, loss, engine = _built("dict_features")
    x, y = family.batch(model, 5)
    wide = {k: v.astype(np.float64 if v.dtype.kind == "f" else np.int64) for k, v in x.items()}
    result = engine.per_example_gradients(wide, y.astype(np.int64))
    losses, grads = oracle.per_example(model, loss, x, y)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


_TRANSFORMER_WITHOUT_XLA = """
from pergrad.server.engine import Engine
from pergrad.server.engine.engine import UNREACHED
from pergrad.server.errors import InvalidArgument
from tests import oracle, zoo_keras_hub
from tests.helpers import assert_close
from tests.zoo import FAMILIES

family = FAMILIES["transformer_encoder"]
model, loss = family.build()
engine = Engine(model, loss=loss, jit_compile=False)
x, y = family.batch(model, 3)
losses, grads = oracle.per_example(model, loss, x, y)
for _ in range(5):
    assert_close(engine.per_example_gradients(x, y).gradients, grads)
"""


def test_transformer_with_a_vectorized_layer_without_xla() -> None:
    """jit_compile=False (the server's --jit-compile off) on attention with a variable on
    the vectorized route: run in a process of its own, since a crash in TensorFlow's
    kernels (heap corruption, abort) would take the test session down with it."""
    done = subprocess.run(
        [sys.executable, "-c", _TRANSFORMER_WITHOUT_XLA],
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-1500:]}"


@pytest.mark.parametrize("name", ["cnn_batch_norm", "dict_features", "custom_loss", "multi_label"])
def test_oracle_mean_is_keras_batch_gradient(name: str) -> None:
    """The oracle itself: the mean of its per-example losses and gradients is Keras' loss
    of the whole batch and its gradient (no mask: then the two means agree)."""
    family = FAMILIES[name]
    model, loss = family.build()
    x, y = family.batch(model, 4)
    losses, grads = oracle.per_example(model, loss, x, y)
    loss_fn = loss if isinstance(loss, keras.losses.Loss) else None
    with tf.GradientTape() as tape:
        out = model(x, training=False)
        batch = loss_fn(y, out) if loss_fn else tf.reduce_mean(loss(y, out))
    want = tape.gradient(batch, model.trainable_variables)
    assert_close({"loss": np.mean(losses, keepdims=True)}, {"loss": batch.numpy()[None]})
    assert_close(
        {name: g.mean(axis=0) for name, g in grads.items()},
        {
            v.path: tf.convert_to_tensor(g).numpy()
            for v, g in zip(model.trainable_variables, want, strict=True)
        },
    )
