"""Adding a reduction the way a contributor does, in a copy of the source tree.

Three edits: a named enum value and an option field of its own in gradient_service.proto
(then `make protos`), one `Reduction` in `wire/catalogue.py`, one engine module in
`server/engine/reductions/`. Everything else takes it as it is: a server and clients run
from the copy (its folders mapped to import names as pyproject.toml's package-dir maps
them), the client asks for the reduction by name and reads its output, micro-batches merge
it by its declaration, the server checks its option and labels its metrics with it, the
CLI makes its flag and writes its file, reflection describes its field.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from tests.conftest import ROOT, package_dir
from tests.helpers import READY
from tests.prometheus import scrape

NAME = "scaled_squares"
# The next free numbers, from the contract itself.
NUMBER = max(pb.Reduction.values()) + 1
FIELD_NUMBER = max(f.number for f in pb.GradientsRequest.DESCRIPTOR.fields) + 1

PROTO_ENUM = f"  REDUCTION_{NAME.upper()} = {NUMBER};\n"
PROTO_FIELD = f"""
  // {NAME}: what each squared norm is multiplied by; required, at least 0.
  optional double factor = {FIELD_NUMBER};
"""
CATALOGUE_ENTRY = f'''    Reduction(
        "{NAME}",
        {NUMBER},
        "per-example squared norms times a factor",
        options=(Option("factor", "float", "the factor", required=True, minimum=0),),
        outputs=(Output("{NAME}", False, "example", ("B",), "factor * ||g_b||^2"),),
    ),
'''
ENGINE_MODULE = '''"""Per-example squared norms, scaled: a reduction a contributor added."""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.reductions.norms import squared


class ScaledSquares:
    def __init__(self, variables: Sequence[Any], *, factor: float) -> None:
        self._variables, self._factor, self._parts = variables, factor, []

    def add(self, grads: Mapping[str, Any]) -> None:
        self._parts.append(sum(squared(self._variables, grads).values()))

    def finish(self) -> dict[str, Any]:
        return {"scaled_squares": (self._factor * np.concatenate(self._parts)).astype(np.float32)}


REDUCTION = ScaledSquares
'''


def _insert(path: Path, before: str, text: str, after: str = "") -> None:
    """`text` inserted into the file at `path` just before the first `before` that follows
    `after` (a contributor's edit)."""
    source = path.read_text()
    at = source.index(before, source.index(after))
    path.write_text(source[:at] + text + source[at:])


def _contributed_tree(tree: Path) -> Path:
    """The copy with the three edits and its protos regenerated; returns the folder to put
    on PYTHONPATH."""
    folders = package_dir()
    for item in ["Makefile", "pyproject.toml", *folders.values()]:
        top = item.split("/")[0]
        if (ROOT / top).is_dir():
            shutil.copytree(ROOT / top, tree / top, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / top, tree / top)
    proto = tree / "protos/pergrad/v1/gradient_service.proto"
    _insert(proto, "}\n", PROTO_ENUM, after="enum Reduction {")
    _insert(proto, "}\n", PROTO_FIELD, after="message GradientsRequest {")
    _insert(tree / "wire/catalogue.py", ")\n", CATALOGUE_ENTRY, after="DEFAULT_REDUCTIONS = (")
    (tree / f"server/engine/reductions/{NAME}.py").write_text(ENGINE_MODULE)
    make = ["make", "-C", str(tree), "-o", "install", f"PY={sys.executable}", "protos"]
    subprocess.run(make, check=True, capture_output=True, timeout=120)
    # The import names, as package-dir maps them: "pergrad" is a folder, the rest inside it.
    base = tree / folders["pergrad"]
    for name, folder in folders.items():
        if name != "pergrad":
            (base / name.removeprefix("pergrad.").replace(".", "/")).symlink_to(tree / folder)
    return base.parent


@dataclass
class Contributed:
    env: dict[str, str]
    target: str
    metrics_port: int

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A Python process on the copy (`-c SCRIPT` or `-m MODULE`), failing the test
        with its stderr if it fails."""
        done = subprocess.run(
            [sys.executable, *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def client(self, script: str, *args: str) -> object:
        """What `script` prints as JSON, run with the target as argv[1]."""
        return json.loads(self.run("-c", script, self.target, *args).stdout)


@pytest.fixture(scope="module")
def contributed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Contributed]:
    path = _contributed_tree(tmp_path_factory.mktemp("tree"))
    env = {**os.environ, "PYTHONPATH": str(path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    serve = [sys.executable, "-m", "pergrad.cli", "serve", "--model", "mnist_mlp"]
    flags = ["--jit-compile", "off", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    server = subprocess.Popen(
        [*serve, *flags], env=env, cwd=path, stderr=subprocess.PIPE, text=True
    )
    log = []
    for line in server.stderr:
        log.append(line)
        if match := READY.search(line):
            break
    try:
        assert match, "".join(log)
        threading.Thread(target=server.stderr.read, daemon=True).start()
        yield Contributed(env, match.group(1), int(match.group(2)))
    finally:
        server.kill()
        server.wait(timeout=30)


BATCH = """
import numpy as np
rng = np.random.default_rng(6)
x, y = rng.standard_normal((10, 784)), rng.integers(0, 10, size=10)
"""

BY_NAME = (
    BATCH
    + """
import json, sys
from pergrad.client import GradientClient
from pergrad.v1 import gradient_service_pb2 as pb
with GradientClient(sys.argv[1]) as client:
    norms = client.per_example_gradients("mnist_mlp", x, y, reduction="norms").norms
    scaled = client.per_example_gradients("mnist_mlp", x, y, reduction=sys.argv[2], factor=3.0)
print(json.dumps({"enum": pb.Reduction.Value("REDUCTION_" + sys.argv[2].upper()),
                  "norms": norms.tolist(), "scaled": getattr(scaled, sys.argv[2]).tolist()}))
"""
)


def test_the_client_asks_for_it_by_name_and_reads_its_output(contributed: Contributed) -> None:
    got = contributed.client(BY_NAME, NAME)
    assert got["enum"] == NUMBER
    norms = np.asarray(got["norms"], np.float64)
    np.testing.assert_allclose(got["scaled"], 3.0 * norms**2, rtol=1e-5)


MERGED = (
    BATCH
    + """
import json, sys
from pergrad.client import GradientClient
with GradientClient(sys.argv[1]) as whole, GradientClient(sys.argv[1], micro_batch=3) as parts:
    one, merged = (c.per_example_gradients("mnist_mlp", x, y, reduction=sys.argv[2], factor=1)
                   for c in (whole, parts))
print(json.dumps([getattr(r, sys.argv[2]).tolist() for r in (one, merged)]))
"""
)


def test_micro_batches_merge_it_by_its_declaration(contributed: Contributed) -> None:
    one, merged = contributed.client(MERGED, NAME)
    assert len(merged) == 10
    np.testing.assert_allclose(merged, one, rtol=1e-6)


REFUSED = (
    BATCH
    + """
import json, sys
import grpc
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as rpc
with grpc.insecure_channel(sys.argv[1]) as channel:  # no client-side check on the way
    request = pb.GradientsRequest(model="mnist_mlp", reduction=int(sys.argv[2]), factor=-1)
    try:
        stub = rpc.GradientServiceStub(channel)
        list(stub.ComputePerExampleGradients(iter([request]), timeout=30))
        print(json.dumps(None))
    except grpc.RpcError as err:
        print(json.dumps([err.code().name, err.details()]))
"""
)


def test_the_server_checks_its_option_where_it_arrives(contributed: Contributed) -> None:
    code, details = contributed.client(REFUSED, str(NUMBER))
    assert code == "INVALID_ARGUMENT"
    assert "factor" in details and NAME in details


def test_the_server_labels_its_metrics_with_it(contributed: Contributed) -> None:
    contributed.client(BY_NAME, NAME)
    assert f'reduction="{NAME}"' in scrape(contributed.metrics_port)


def test_the_cli_takes_its_flag_and_writes_its_file(
    contributed: Contributed, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((5, 784)), y=rng.integers(0, 10, 5))
    help_text = contributed.run("-m", "pergrad.cli", "grads", "--help").stdout
    assert "--factor" in help_text
    grads = ["-m", "pergrad.cli", "grads", "--target", contributed.target, "--model", "mnist_mlp"]
    files = ["--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / "out.npz")]
    options = ["--batch-size", "2", "--reduction", NAME, "--factor", "2", "--quiet"]
    contributed.run(*grads, *files, *options)
    assert np.load(tmp_path / "out.npz")[NAME].shape == (5,)


REFLECTED = """
import json, sys
import grpc
from grpc_reflection.v1alpha import reflection_pb2 as rf, reflection_pb2_grpc as rf_rpc
from google.protobuf import descriptor_pb2
with grpc.insecure_channel(sys.argv[1]) as channel:
    ask = rf.ServerReflectionRequest(file_containing_symbol="pergrad.v1.GradientsRequest")
    answer = next(rf_rpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask])))
files = [descriptor_pb2.FileDescriptorProto.FromString(f)
         for f in answer.file_descriptor_response.file_descriptor_proto]
proto = next(f for f in files if f.name.endswith("gradient_service.proto"))
request = next(m for m in proto.message_type if m.name == "GradientsRequest")
reduction = next(e for e in proto.enum_type if e.name == "Reduction")
print(json.dumps({"fields": {f.name: f.number for f in request.field},
                  "values": {v.name: v.number for v in reduction.value}}))
"""


def test_reflection_describes_its_enum_value_and_field(contributed: Contributed) -> None:
    got = contributed.client(REFLECTED)
    assert got["fields"]["factor"] == FIELD_NUMBER
    assert got["values"][f"REDUCTION_{NAME.upper()}"] == NUMBER
