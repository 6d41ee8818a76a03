"""Loading `.keras` files safely: only from inside the model directory, never unsafe code."""

from __future__ import annotations

import zipfile
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
    """Load with safe_mode=True: a Lambda layer or other pickled code is refused.

    A file that is not a whole .keras archive (no config.json, not a zip, a truncated
    weights file) is a ModelLoadError too, whatever Keras raises for it.
    """
    try:
        model = keras.saving.load_model(path, safe_mode=True, compile=True)
    except ValueError as err:
        raise ModelLoadError(f"model {str(path)!r} cannot be loaded safely: {err}") from err
    except (KeyError, OSError, TypeError, AttributeError, zipfile.BadZipFile) as err:
        raise ModelLoadError(
            f"model {str(path)!r} is not a usable .keras file ({type(err).__name__}: {err}); "
            "save it again with model.save(path)"
        ) from err
    if not isinstance(model, keras.Model):
        raise ModelLoadError(f"model {str(path)!r} is not a Keras model")
    return model
