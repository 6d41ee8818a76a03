"""The checked-in generated code and descriptors are exactly what `make protos` produces now."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = sorted(
    p.name
    for p in (ROOT / "protos/pergrad/v1").iterdir()
    if "_pb2" in p.name or p.name == "descriptors.binpb"
)


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    source = tmp_path / "protos"
    shutil.copytree(
        ROOT / "protos",
        source,
        ignore=shutil.ignore_patterns("*_pb2*", "descriptors.binpb", "__pycache__"),
    )
    protos = sorted(str(p.relative_to(source)) for p in source.glob("pergrad/v1/*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            *protos,
        ],
        cwd=source,
        check=True,
        timeout=60,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--include_source_info",
            "--descriptor_set_out=pergrad/v1/descriptors.binpb",
            *protos,
        ],
        cwd=source,
        check=True,
        timeout=60,
    )
    fresh = sorted(
        p.name
        for p in (source / "pergrad/v1").iterdir()
        if "_pb2" in p.name or p.name == "descriptors.binpb"
    )
    assert fresh == GENERATED
    _, mismatch, errors = filecmp.cmpfiles(
        source / "pergrad/v1", ROOT / "protos/pergrad/v1", GENERATED, shallow=False
    )
    assert not mismatch and not errors, (
        f"stale generated code: {mismatch + errors}; run make protos"
    )
