"""What the registry says as it serves a model: a keras-hub task's loss, and whose."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pergrad.server.models.registry import load_model
from tests.zoo import FAMILIES


def test_a_keras_hub_task_says_its_loss_is_the_tasks_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keras restores a keras-hub task's own compile(), not the one it was saved with."""
    model, _ = FAMILIES["gpt2_causal_lm_task"].build()
    model.save(tmp_path / "lm.keras")
    with caplog.at_level(logging.WARNING):
        served = load_model("lm.keras", model_dir=tmp_path, jit_compile=False)
    assert served.engine.label_spec.shape == (None,)  # next-token labels of any length
    said = "keras-hub GPT2CausalLM: Keras restores a task's own default compile()"
    assert said in caplog.text
    assert f"its loss here is {served.engine.loss.description}; --loss" in caplog.text
