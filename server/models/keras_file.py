"""Loading `.keras` files safely: only from inside the model directory, never unsafe code."""

from __future__ import annotations

from pathlib import Path

import keras


class ModelLoadError(ValueError):
    """A model file that cannot be served; the message says why and what to do."""


def resolve_model_path(path: str, model_dir: Path | None) -> Path:
    """The file `path` names, confined to `model_dir` when one is configured.

    Relative paths are taken inside `model_dir`; any path whose real location (symlinks
    resolved) lies outside it is refused.
    """
    candidate = Path(path)
    if model_dir is not None:
        root = model_dir.resolve()
        resolved = (root / candidate).resolve()
        if not resolved.is_relative_to(root):
            raise ModelLoadError(f"model {path!r} lies outside --model-dir {str(root)!r}")
    else:
        resolved = candidate.resolve()
    if resolved.suffix != ".keras":
        raise ModelLoadError(f"model {path!r}: only .keras files are served")
    if not resolved.is_file():
        raise ModelLoadError(f"model {path!r}: no such file")
    return resolved


def load_keras_file(path: Path) -> keras.Model:
    """Load with safe_mode=True: a Lambda layer or other pickled code is refused."""
    try:
        model = keras.saving.load_model(path, safe_mode=True, compile=True)
    except ValueError as err:
        raise ModelLoadError(f"model {str(path)!r} cannot be loaded safely: {err}") from err
    if not isinstance(model, keras.Model):
        raise ModelLoadError(f"model {str(path)!r} is not a Keras model")
    return model
