"""The wheel: every package mapped, the protos inside, TensorFlow only in the server extra."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_package_and_keeps_tensorflow_optional(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pergrad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in [
        "pergrad/__init__.py",
        "pergrad/v1/gradient_service_pb2.py",
        "pergrad/v1/gradient_service.proto",
        "pergrad/client/_client.py",
        "pergrad/client/cli.py",
        "pergrad/server/engine/engine.py",
        "pergrad/server/models/builtin.py",
    ]:
        assert expected in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    metadata = next(n for n in names if n.endswith("METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    base = [line for line in requires if "extra ==" not in line]
    assert not [line for line in base if "tensorflow" in line]
    assert [line for line in requires if "tensorflow" in line and 'extra == "server"' in line]
