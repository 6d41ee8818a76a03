"""Adding a reduction takes three places: an enum value, a catalogue entry, an engine class.

Here all three are the test's own (a proto3 enum is open, so an unnamed value travels, and
the new option rides in an existing double field, as a new reduction's option would in
a field of its own; the engine class joins the default registry, as a module of
`pergrad.server.engine.reductions` would), and everything else, the client, its
micro-batch merging and result type, the server's parsing, pricing and metrics, and the
CLI's flags and files, takes it as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pergrad.cli import main as cli
from pergrad.client import GradientClient
from pergrad.server.engine import Engine
from pergrad.server.engine.reductions import default_reductions
from pergrad.server.engine.reductions.norms import squared
from pergrad.server.main import RunningServer, start
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.models.registry import ModelRegistry, ServedModel
from pergrad.server.weights import WeightsStore
from pergrad.wire.catalogue import CATALOGUE, Option, Output, Reduction
from tests.helpers import batch_for, loopback_config
from tests.prometheus import scrape

SCALED = Reduction(
    "scaled_squares",
    99,
    "per-example squared norms times a factor (a reduction only this test knows)",
    options=(
        Option("factor", "float", "the factor", wire_field="max_norm", required=True, minimum=0),
    ),
    outputs=(Output("scaled_squares", False, "example", ("B",), "factor * ||g_b||^2"),),
)


class ScaledSquares:
    """The engine's side: squared norms from the factored gradients, scaled."""

    def __init__(self, variables: Sequence[Any], *, factor: float) -> None:
        self._variables, self._factor, self._parts = variables, factor, []

    def add(self, grads: Mapping[str, Any]) -> None:
        self._parts.append(sum(squared(self._variables, grads).values()))

    def finish(self) -> dict[str, Any]:
        return {"scaled_squares": (self._factor * np.concatenate(self._parts)).astype(np.float32)}


@pytest.fixture(scope="module")
def extended_server() -> Iterator[RunningServer]:
    classes = default_reductions()
    classes.register(SCALED.name, ScaledSquares)
    engine = Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, jit_compile=False, reductions=classes)
    served = ServedModel(
        "mnist_mlp", engine, WeightsStore(engine.variables, engine.initial_weights())
    )
    with CATALOGUE.extended(SCALED):
        running = start(loopback_config("mnist_mlp"), ModelRegistry([served]))
        yield running
        running.stop(0)


def test_the_client_asks_for_it_and_reads_its_output(extended_server) -> None:
    x, y = batch_for((784,), 10, 6)
    with GradientClient(f"127.0.0.1:{extended_server.port}") as client:
        norms = client.per_example_gradients("mnist_mlp", x, y, reduction="norms").norms
        result = client.per_example_gradients(
            "mnist_mlp", x, y, reduction="scaled_squares", factor=3.0
        )
    np.testing.assert_allclose(
        result.scaled_squares, 3.0 * norms.astype(np.float64) ** 2, rtol=1e-5
    )


def test_micro_batches_merge_it_by_its_declaration(extended_server) -> None:
    x, y = batch_for((784,), 10, 7)
    target = f"127.0.0.1:{extended_server.port}"
    with GradientClient(target) as whole, GradientClient(target, micro_batch=3) as parts:
        one = whole.per_example_gradients("mnist_mlp", x, y, reduction="scaled_squares", factor=1)
        merged = parts.per_example_gradients(
            "mnist_mlp", x, y, reduction="scaled_squares", factor=1
        )
    np.testing.assert_allclose(merged.scaled_squares, one.scaled_squares, rtol=1e-6)


def test_the_server_checks_its_options_and_labels_its_metrics(extended_server) -> None:
    x, y = batch_for((784,), 10, 2)
    with GradientClient(f"127.0.0.1:{extended_server.port}") as client:
        with pytest.raises(Exception, match="factor: scaled_squares needs"):
            client.per_example_gradients("mnist_mlp", x, y, reduction="scaled_squares")
        client.per_example_gradients("mnist_mlp", x, y, reduction="scaled_squares", factor=2)
    exposition = scrape(extended_server.metrics_port)
    assert 'reduction="scaled_squares"' in exposition


def test_the_cli_takes_its_flag_and_writes_its_file(extended_server, tmp_path: Path) -> None:
    x, y = batch_for((784,), 10, 5)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    code = cli(
        [
            "grads",
            "--target",
            f"127.0.0.1:{extended_server.port}",
            "--model",
            "mnist_mlp",
            "--data",
            str(tmp_path / "data.npz"),
            "--out",
            str(tmp_path / "out.npz"),
            "--batch-size",
            "2",
            "--reduction",
            "scaled_squares",
            "--factor",
            "2",
            "--quiet",
        ]
    )
    assert code == 0
    assert np.load(tmp_path / "out.npz")["scaled_squares"].shape == (5,)
