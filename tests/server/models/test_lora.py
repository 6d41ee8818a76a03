"""LoRA served: `--lora` enables it on a .keras model at load (the file holds none: Keras
merged it into the kernels on save), only the LoRA factors and the head train, and DP
steps on the server move them; against the oracle on the same model with LoRA enabled
in process the same way."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np
import pytest

from pergrad.client import GradientClient
from pergrad.server.lora_spec import parse_lora
from pergrad.server.main import RunningServer, start
from pergrad.server.models.keras_file import ModelLoadError, load_keras_file
from pergrad.server.models.lora import enable_lora
from pergrad.server.models.registry import load_model
from tests import oracle
from tests import zoo_keras_hub as hub
from tests.helpers import KERAS_MODEL_NAME, assert_close, loopback_config

NAME = "gpt2_classifier"
LORA = "rank=2,alpha=4"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A keras-hub GPT-2 classifier fine-tuned with LoRA, saved: the file holds no LoRA."""
    model, loss = hub.classifier("gpt2", 330, lora=True)()
    model.compile(loss=loss)
    directory = tmp_path_factory.mktemp("lora")
    model.save(directory / f"{NAME}.keras")
    return directory


@pytest.fixture(scope="module")
def served(saved: Path) -> Iterator[GradientClient]:
    running: RunningServer = start(
        loopback_config(f"{NAME}.keras", model_dir=saved, lora=LORA, optimizer="adam")
    )
    with GradientClient(f"127.0.0.1:{running.port}", timeout=120) as client:
        yield client
    running.stop(0)


def _twin(saved: Path) -> keras.Model:
    """The served model as the server makes it: loaded, then LoRA enabled the same way."""
    model = load_keras_file(saved / f"{NAME}.keras")
    enable_lora(model, parse_lora(LORA))
    return model


def test_only_the_lora_factors_and_the_head_train(served: GradientClient) -> None:
    info = served.model_info(NAME)
    names = [v.name for v in info.variables]
    factors = sorted(n.split("/")[-2:][0] + "/" + n.split("/")[-1] for n in names if "lora" in n)
    assert factors == [f"{layer}/lora_kernel_{ab}" for layer in ("query", "value") for ab in "ab"]
    assert sorted(n for n in names if "lora" not in n) == ["head/bias", "head/kernel"]
    assert info.lora.startswith("LoRA rank 2, alpha 4 on 2 layers (query, value)")
    assert all(route.startswith("rule: ") for route in info.routes), info.routes


def test_served_lora_gradients_match_the_oracle(served: GradientClient, saved: Path) -> None:
    twin = _twin(saved)
    x, y = hub.batch(twin, 3)
    _, current = served.get_weights(NAME)  # after any step another test took
    losses, grads = oracle.per_example(twin, twin.loss, x, y, weights=current)
    result = served.per_example_gradients(NAME, x, y)
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


def test_a_dp_step_moves_every_lora_factor_and_the_head(
    served: GradientClient, saved: Path
) -> None:
    """The step reports how far it moved each variable, and with DP noise every one moves
    (B starts at zero, where A's own gradient is zero)."""
    x, y = hub.batch(_twin(saved), 4)
    before = served.get_weights(NAME)[1]
    step = served.step(NAME, x, y, learning_rate=1e-2, max_norm=1.0, noise_multiplier=1.0, seed=5)
    after = served.get_weights(NAME)[1]
    assert sorted(step.update_norms) == sorted(before)
    assert step.unmoved == []
    for name, moved in step.update_norms.items():
        np.testing.assert_allclose(
            moved, np.linalg.norm(after[name] - before[name]), rtol=1e-5, atol=1e-7
        )


def test_a_model_without_a_backbone_needs_its_targets_named(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"holds no keras-hub backbone .* name the layers"):
        load_model(f"{KERAS_MODEL_NAME}.keras", model_dir=model_dir, lora=parse_lora("rank=2"))


def test_an_unknown_target_is_refused_naming_the_layers_there_are(saved: Path) -> None:
    refused = r"no layer that takes LoRA named \['quer'\].*'query'"
    with pytest.raises(ModelLoadError, match=refused):
        load_model(f"{NAME}.keras", model_dir=saved, lora=parse_lora("rank=2,targets=quer"))


def test_a_keras_hub_model_served_without_lora_says_every_weight_trains(
    saved: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        load_model(f"{NAME}.keras", model_dir=saved, jit_compile=False)
    assert "saved with LoRA loses it" in caplog.text and "--lora rank=R" in caplog.text


def test_replicas_that_enable_the_same_lora_start_from_the_same_weights(saved: Path) -> None:
    """The factors' initial values are seeded: two servers of one file agree by content."""
    spec = parse_lora(LORA)
    # XLA pinned: "auto" times both routes, and a busy machine may time them otherwise
    first, second = (
        load_model(f"{NAME}.keras", model_dir=saved, lora=spec, jit_compile=False) for _ in "ab"
    )
    assert first.weights.current.weights_id == second.weights.current.weights_id
    assert first.engine.plan_id == second.engine.plan_id
