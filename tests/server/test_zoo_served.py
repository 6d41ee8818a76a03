"""Zoo models saved as .keras files, served by a real server, against the Keras oracle.

Three families of tests/zoo.py (a dict of inputs, an LSTM text model, a regression) and
every keras-hub classifier and task without LoRA (Keras' save merges LoRA into the
kernels; a functional model that calls a backbone's table in reverse does not load again,
keras-hub's GPT2CausalLM task does) are
compiled with their Keras loss, saved with model.save, loaded by the server from its
model directory (safe mode) and asked for per-example gradients through the real
client; the oracle runs on the models as they were before saving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from tests import oracle, zoo_keras_hub
from tests.helpers import assert_close, loopback_config
from tests.zoo import FAMILIES

KERAS_HUB = tuple(
    name
    for name, family in FAMILIES.items()
    if family.build.__module__ == zoo_keras_hub.__name__ and name.endswith(("_classifier", "_task"))
)
SERVED = ("dict_features", "lstm_text", "regression", *KERAS_HUB)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[keras.Model, Any]]]:
    directory: Path = tmp_path_factory.mktemp("zoo")
    models = {}
    for name in SERVED:
        model, loss = FAMILIES[name].build()
        model.compile(loss=loss)
        model.save(directory / f"{name}.keras")
        models[name] = (model, loss)
    running: RunningServer = start(
        loopback_config(*(f"{name}.keras" for name in SERVED), model_dir=directory)
    )
    with GradientClient(f"127.0.0.1:{running.port}", timeout=120) as client:
        yield {"client": client, **models}
    running.stop(0)


def test_every_saved_model_is_served(zoo) -> None:
    assert zoo["client"].list_models() == sorted(SERVED)


@pytest.mark.parametrize("name", SERVED)
def test_served_gradients_match_keras_oracle(zoo, name: str) -> None:
    model, loss = zoo[name]
    x, y = FAMILIES[name].batch(model, 5)
    result = zoo["client"].per_example_gradients(name, x, y)
    losses, grads = oracle.per_example(model, loss, x, y)
    assert result.model == name
    assert_close({"losses": result.losses}, {"losses": losses})
    assert_close(result.gradients, grads)


def test_dict_model_takes_its_inputs_by_name_over_the_wire(zoo) -> None:
    model, loss = zoo["dict_features"]
    assert sorted(i.name for i in zoo["client"].model_info("dict_features").inputs) == [
        "category",
        "numeric",
    ]
    x, y = FAMILIES["dict_features"].batch(model, 3)
    by_list = zoo["client"].per_example_gradients("dict_features", [x["category"], x["numeric"]], y)
    _, grads = oracle.per_example(model, loss, x, y)
    assert_close(by_list.gradients, grads)


def test_served_norms_and_clipped_sum_match_keras_oracle(zoo) -> None:
    model, loss = zoo["lstm_text"]
    x, y = FAMILIES["lstm_text"].batch(model, 5)
    _, grads = oracle.per_example(model, loss, x, y)
    norms = oracle.per_example_norms(grads)
    client = zoo["client"]
    result = client.per_example_gradients("lstm_text", x, y, reduction="norms")
    assert_close({"norms": result.norms}, {"norms": norms})
    max_norm = float((norms.min() + norms.max()) / 2)
    clipped = client.per_example_gradients(
        "lstm_text", x, y, reduction="clipped_sum", max_norm=max_norm
    )
    assert clipped.num_clipped == int((norms > max_norm).sum())
    assert_close(clipped.clipped_sum, oracle.clipped_sum(grads, max_norm))


def test_a_token_id_outside_the_vocabulary_is_invalid_argument_over_the_wire(zoo) -> None:
    model, _ = zoo["gpt2_classifier"]
    x, y = FAMILIES["gpt2_classifier"].batch(model, 3)
    x["token_ids"][2, 0] = zoo_keras_hub.VOCABULARY
    with pytest.raises(PergradError) as refused:
        zoo["client"].per_example_gradients("gpt2_classifier", x, y, reduction="norms")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "examples [2] hold ids outside [0, 50)" in refused.value.message
