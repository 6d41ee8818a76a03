"""WeightsStore driven directly: a computation sees all-old or all-new weights, never a mix,
and a refused update changes nothing.

Deterministic: the update runs at a chosen point, between a real Engine's reads of the
snapshot's variables, rather than whenever threads happen to meet (the live race is
tests/server/test_hardening.py's).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.engine import Engine, VariableSpec
from pergrad.server.errors import InvalidArgument
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.weights import Snapshot, WeightsStore, weights_id
from tests import oracle
from tests.helpers import assert_close, batch_for


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODELS["mnist_mlp"](), loss=LOSS, jit_compile=False)


@pytest.fixture()
def store(engine: Engine) -> WeightsStore:
    return WeightsStore(engine.variables, engine.passes.initial_weights())


def _values(snapshot: Snapshot) -> list[np.ndarray]:
    return [tensor.numpy() for tensor in snapshot.trainable]


def _assert_holds(snapshot: Snapshot, values: Sequence[np.ndarray]) -> None:
    for got, want in zip(_values(snapshot), values, strict=True):
        np.testing.assert_array_equal(got, want)


def _plus_one(engine: Engine, snapshot: Snapshot) -> dict[str, np.ndarray]:
    """New values for every variable: its value in `snapshot` plus one."""
    return {v.name: value + 1 for v, value in zip(engine.variables, _values(snapshot), strict=True)}


def test_a_held_snapshot_keeps_its_values_through_a_replace(engine, store) -> None:
    held = store.get()
    before = _values(held)
    new = _plus_one(engine, held)
    store.replace(new)
    _assert_holds(held, before)
    assert store.current.version == held.version + 1
    _assert_holds(store.current, [new[v.name] for v in engine.variables])


class _PauseAfterFirstRead(Sequence):
    """A snapshot's tensors as a computation reads them: after the first one it signals
    `first_read` and waits for `resume` before reading the rest."""

    def __init__(self, tensors: Sequence[tf.Tensor]) -> None:
        self._tensors = tensors
        self.first_read, self.resume = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, index: int) -> tf.Tensor:
        if index == 1:
            self.first_read.set()
            assert self.resume.wait(60), "the update never finished"
        return self._tensors[index]


def test_a_computation_reads_all_old_weights_when_replaced_between_its_reads(engine, store) -> None:
    """A request computing with snapshot v1 while v2 is swapped in after it read its first
    variable gets v1's gradients for every variable."""
    x, y = batch_for((784,), 10, 3, seed=4)
    held = store.get()
    paths = [v.path for v in engine.model.trainable_variables]
    old = dict(zip(paths, _values(held), strict=True))
    reads = _PauseAfterFirstRead(held.trainable)
    with ThreadPoolExecutor(1) as pool:
        computing = pool.submit(engine.per_example_gradients, x, y, trainable=reads)
        try:
            assert reads.first_read.wait(60), "the computation never read its weights"
            store.replace(_plus_one(engine, held))
        finally:
            reads.resume.set()
        result = computing.result(timeout=120)
    assert store.current.version == 2
    _, grads = oracle.per_example(engine.model, LOSS, x, y, weights=old)
    assert_close(result.gradients, grads)


def _with_nan_last(array: np.ndarray) -> np.ndarray:
    broken = array.copy()
    broken.flat[-1] = np.nan
    return broken


FAULTS = {
    "dtype": lambda a: a.astype(np.float64),
    "shape": lambda a: np.concatenate([a, a[:1]]),
    "nan": _with_nan_last,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_refused_replace_changes_nothing(engine, store, fault: str) -> None:
    """Every variable new but the last one broken: refused, and the store still holds the
    same snapshot with the same values."""
    held = store.get()
    before = _values(held)
    new = _plus_one(engine, held)
    last = engine.variables[-1].name
    new[last] = FAULTS[fault](new[last])
    with pytest.raises(InvalidArgument, match=last):
        store.replace(new)
    assert store.current is held
    assert store.get(version=1) is held
    _assert_holds(held, before)


def test_weights_id_tells_which_variable_holds_which_values() -> None:
    """The same bytes under other names, or in other variables, are other weights: a pin
    by weights_id must not pass against renamed or permuted weights."""
    float32 = np.dtype(np.float32)
    specs = [
        VariableSpec(0, "a/kernel", float32, (2, 2)),
        VariableSpec(1, "b/kernel", float32, (2, 2)),
    ]
    ones, twos = np.ones((2, 2), np.float32), np.full((2, 2), 2, np.float32)
    renamed = [VariableSpec(0, "c/kernel", float32, (2, 2)), specs[1]]
    identity = weights_id(specs, [ones, twos])
    assert weights_id(specs, [twos, ones]) != identity
    assert weights_id(renamed, [ones, twos]) != identity
    assert weights_id(list(specs), [ones.copy(), twos.copy()]) == identity
