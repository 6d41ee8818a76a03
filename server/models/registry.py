"""The models a server holds: each an engine plus its versioned weights."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras

from pergrad.server.config import Config
from pergrad.server.engine import Engine
from pergrad.server.engine.compiled import JitCompile
from pergrad.server.errors import NotFound
from pergrad.server.lora_spec import LoraSpec
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.models.keras_file import ModelLoadError, load_keras_file, resolve_model_path
from pergrad.server.models.lora import enable_lora, warn_if_lora_lost
from pergrad.server.optimizer_spec import OptimizerSpec, parse_optimizer
from pergrad.server.recent_steps import RecentSteps
from pergrad.server.training import Trainer
from pergrad.server.weights import WeightsStore
from pergrad.wire.text import quoted

DEFAULT_OPTIMIZER = parse_optimizer(Config.optimizer)
NO_LORA = LoraSpec()

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str
    engine: Engine
    weights: WeightsStore
    trainer: Trainer
    lora: str = ""  # what --lora enabled (ModelInfo.lora); empty: off
    recent_steps: RecentSteps = field(default_factory=RecentSteps)


def serve_model(
    name: str,
    model: keras.Model,
    *,
    loss: Any = None,
    jit_compile: JitCompile = "auto",
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    lora: LoraSpec = NO_LORA,
) -> ServedModel:
    described = enable_lora(model, lora) if lora else ""
    if not lora:
        warn_if_lora_lost(model)
    try:
        engine = Engine(model, loss=loss, jit_compile=jit_compile)
    except ValueError as err:
        raise ModelLoadError(f"model {name!r} cannot be served: {err}") from err
    if loss is None and _is_keras_hub_task(model):
        _LOGGER.warning(
            "model %s is a keras-hub %s: Keras restores a task's own default compile(), not "
            "the one it was saved with, so its loss here is %s; --loss chooses another",
            name,
            type(model).__name__,
            engine.loss.description,
        )
    weights = WeightsStore(engine.variables, engine.passes.initial_weights())
    return ServedModel(name, engine, weights, Trainer(model, optimizer), described)


def _is_keras_hub_task(model: keras.Model) -> bool:
    return any(
        kind.__name__ == "Task" and kind.__module__.startswith("keras_hub")
        for kind in type(model).__mro__
    )


def load_model(
    spec: str,
    *,
    model_dir: Path | None,
    loss: Any = None,
    jit_compile: JitCompile = "auto",
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    lora: LoraSpec = NO_LORA,
) -> ServedModel:
    """A built-in model by name, or a `.keras` file (named by its file stem)."""
    if spec in BUILTIN_MODELS:
        model, loss = BUILTIN_MODELS[spec](), loss or LOSS
    else:
        path = resolve_model_path(spec, model_dir)
        spec, model = path.stem, load_keras_file(path)
    return serve_model(
        spec, model, loss=loss, jit_compile=jit_compile, optimizer=optimizer, lora=lora
    )


class ModelRegistry:
    def __init__(self, models: Iterable[ServedModel]) -> None:
        self._models: dict[str, ServedModel] = {}
        for model in models:
            if model.name in self._models:
                raise ValueError(f"two models named {model.name!r}")
            self._models[model.name] = model
            _LOGGER.info("serving model %s", model.name)

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str) -> ServedModel:
        try:
            return self._models[name]
        except KeyError:
            raise NotFound(f"model {quoted(name)} not found; served models: {self.names}") from None
