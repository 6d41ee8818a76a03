"""`.keras` files load only from inside --model-dir and only in Keras safe mode."""

from __future__ import annotations

import importlib.metadata
import zipfile
from pathlib import Path

import keras
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from pergrad.server.models.keras_file import ModelLoadError, load_keras_file, resolve_model_path
from pergrad.server.models.registry import load_model
from pergrad.server.serve import serve
from tests.helpers import KERAS_MODEL_NAME


def test_relative_name_loads_from_the_model_dir(model_dir: Path) -> None:
    served = load_model(f"{KERAS_MODEL_NAME}.keras", model_dir=model_dir)
    assert served.name == KERAS_MODEL_NAME
    assert served.engine.label_spec.num_classes == 5


def test_path_escaping_the_model_dir_is_refused(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="outside --model-dir"):
        resolve_model_path(f"../{model_dir.name}/{KERAS_MODEL_NAME}.keras", model_dir / "sub")


def test_symlink_escaping_the_model_dir_is_refused(model_dir: Path, tmp_path: Path) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "link.keras").symlink_to(model_dir / f"{KERAS_MODEL_NAME}.keras")
    with pytest.raises(ModelLoadError, match="outside --model-dir"):
        resolve_model_path("link.keras", inner)


def test_absolute_path_outside_the_model_dir_is_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="outside --model-dir"):
        resolve_model_path(str(model_dir / f"{KERAS_MODEL_NAME}.keras"), tmp_path)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_model_path("absent.keras", tmp_path)


def test_lambda_layer_is_refused_in_safe_mode(tmp_path: Path) -> None:
    inputs = keras.Input((3,))
    outputs = keras.layers.Lambda(lambda t: t * 2)(inputs)
    keras.Model(inputs, outputs).save(tmp_path / "lambda.keras")
    with pytest.raises(ModelLoadError, match="cannot be loaded safely"):
        load_keras_file(tmp_path / "lambda.keras")


def test_installed_keras_carries_the_safe_mode_fixes() -> None:
    """.keras files are untrusted input: Keras fixed safe_mode bypasses in 3.11 and 3.14."""
    (keras_requirement,) = [
        Requirement(r)
        for r in importlib.metadata.requires("pergrad") or []
        if Requirement(r).name == "keras"
    ]
    floor = min(Version(s.version) for s in keras_requirement.specifier if s.operator == ">=")
    assert floor >= Version("3.14.0")
    assert keras_requirement.specifier.contains(importlib.metadata.version("keras"))


@pytest.mark.parametrize(
    "content",
    [{"metadata.json": "{}"}, {"config.json": "{not json"}, None],
    ids=["no config.json", "broken config.json", "not a zip"],
)
def test_a_file_that_is_no_keras_archive_stops_serve_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: dict | None
) -> None:
    path = tmp_path / "bad.keras"
    if content is None:
        path.write_bytes(b"not a zip at all")
    else:
        with zipfile.ZipFile(path, "w") as archive:
            for name, text in content.items():
                archive.writestr(name, text)
    code = serve(["--model", "bad.keras", "--model-dir", str(tmp_path), "--port", "0"])
    assert code == 2
    error = capsys.readouterr().err
    assert "bad.keras" in error and "Traceback" not in error
