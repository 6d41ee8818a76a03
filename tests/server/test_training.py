"""The optimizer a server steps with: --optimizer read into Keras's own optimizer, and a
Trainer whose steps depend only on what they are given."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.config import ConfigError
from pergrad.server.main import build_registry
from pergrad.server.optimizer_spec import parse_optimizer
from pergrad.server.training import NOT_FROM_A_FLAG, Trainer, keras_optimizers, make_optimizer
from tests.helpers import loopback_config, tabular_model


def test_optimizers_keras_get_does_not_know_are_found_by_class_name() -> None:
    assert isinstance(make_optimizer(parse_optimizer("lamb")), keras.optimizers.Lamb)


def test_settings_are_read_as_numbers_and_booleans() -> None:
    spec = parse_optimizer("SGD: momentum=0.9, nesterov=true")
    assert (spec.name, spec.options) == ("sgd", (("momentum", 0.9), ("nesterov", True)))
    optimizer = make_optimizer(spec)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert (optimizer.momentum, optimizer.nesterov) == (0.9, True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nadamx", "'nadamx' is not a Keras optimizer"),
        ("multi_optimizer", "'multi_optimizer' is not a Keras optimizer a flag can configure"),
        ("sgd:beta_1=0.9", r"SGD takes no \['beta_1'\]"),
        ("adam:clipnorm=1.0", r"Adam takes no \['clipnorm'\]"),
        ("sgd:learning_rate=0.1", r"SGD takes no \['learning_rate'\]"),
    ],
)
def test_optimizers_keras_lacks_are_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_optimizer(parse_optimizer(text))


def test_a_bad_optimizer_stops_the_start_before_any_model_loads() -> None:
    with pytest.raises(ConfigError, match=r"--optimizer 'rmsprop:beta_2=0\.9'"):
        build_registry(loopback_config("no-such-model", optimizer="rmsprop:beta_2=0.9"))


def test_a_step_depends_only_on_the_weights_and_state_it_is_given() -> None:
    """The scratch variables carry nothing between steps: the same inputs give the same
    outputs, whatever ran in between."""
    model = tabular_model()
    trainer = Trainer(model, parse_optimizer("adam"))
    weights = [v.value for v in model.trainable_variables]
    gradient = [tf.ones_like(w) for w in weights]
    with trainer.turn():
        first = trainer.apply(weights, None, gradient, 0.1)
        second = trainer.apply(first.weights, first.state, gradient, 0.1)
        again = trainer.apply(weights, None, gradient, 0.1)
    for a, b in zip(first.weights + first.state, again.weights + again.state, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not np.array_equal(second.weights[0].numpy(), first.weights[0].numpy())
    for variable, value in zip(model.trainable_variables, weights, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value.numpy())


def test_each_step_applies_its_own_learning_rate() -> None:
    """Rates 0.1 then 0.5 from a Trainer, against Keras's optimizer on local variables
    given the same gradients and rates (the state holds the last rate; the step's own
    must win)."""
    model = tabular_model()
    trainer = Trainer(model, parse_optimizer("sgd:momentum=0.9"))
    local = [keras.Variable(v.numpy()) for v in model.trainable_variables]
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(local)
    weights, state = [v.value for v in model.trainable_variables], None
    rng = np.random.default_rng(0)
    for rate in (0.1, 0.5):
        gradient = [rng.standard_normal(w.shape).astype(np.float32) for w in weights]
        with trainer.turn():
            stepped = trainer.apply(weights, state, gradient, rate)
        weights, state = stepped.weights, stepped.state
        optimizer.learning_rate = rate
        optimizer.apply(gradient, local)
    for served, expected in zip(weights, local, strict=True):
        np.testing.assert_allclose(served.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(set(keras_optimizers()) - NOT_FROM_A_FLAG))
def test_every_keras_optimizer_steps_as_keras_applies_it(name: str) -> None:
    """The step runs compiled by XLA: two steps of each optimizer Keras has, from the state
    it builds for the weights, against Keras's own apply on local variables, and what the
    step reports of them."""
    model = tabular_model()
    trainer = Trainer(model, parse_optimizer(name))
    local = [keras.Variable(v.numpy()) for v in model.trainable_variables]
    optimizer = make_optimizer(parse_optimizer(name))
    optimizer.build(local)
    weights, state = [v.value for v in model.trainable_variables], None
    rng = np.random.default_rng(1)
    for _ in range(2):
        gradient = [rng.standard_normal(w.shape).astype(np.float32) for w in weights]
        before = [w.numpy() for w in weights]
        with trainer.turn():
            stepped = trainer.apply(weights, state, gradient, 0.01)
        weights, state = stepped.weights, stepped.state
        optimizer.learning_rate = 0.01
        optimizer.apply(gradient, local)
        moved = [np.linalg.norm(w.numpy() - b) for w, b in zip(weights, before, strict=True)]
        np.testing.assert_allclose(stepped.moved, moved, rtol=1e-4, atol=1e-7)
        norm = np.sqrt(sum(np.square(g.astype(np.float64)).sum() for g in gradient))
        assert stepped.gradient_norm == pytest.approx(norm, rel=1e-5)
        assert all(stepped.finite)
    for served, expected in zip(weights, local, strict=True):
        np.testing.assert_allclose(served.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
