"""Versioned weights: immutable snapshots swapped atomically.

A request takes one snapshot at its start and computes with it to the end, so an
update never tears a computation; an update validates everything before the swap,
so a rejected one changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from pergrad.server.engine import VariableSpec
from pergrad.server.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class Snapshot:
    version: int
    trainable: tuple[tf.Tensor, ...]


class WeightsStore:
    """The current snapshot of one model's trainable variables, starting at version 1."""

    def __init__(self, variables: Sequence[VariableSpec], initial: Sequence[tf.Tensor]) -> None:
        self._variables = tuple(variables)
        self._lock = threading.Lock()
        self._current = Snapshot(1, tuple(initial))

    @property
    def current(self) -> Snapshot:
        return self._current

    def get(self, version: int = 0) -> Snapshot:
        """The current snapshot; with a non-zero `version`, only if that one is current."""
        snapshot = self._current
        if version and version != snapshot.version:
            raise FailedPrecondition(
                f"model_version {version} is not current (current is {snapshot.version}); "
                "fetch the current weights or pin the current version"
            )
        return snapshot

    def check(self, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> None:
        """Refuse unless (name, dtype, shape) covers every variable exactly once."""
        names = [name for name, _, _ in tensors]
        expected = {v.name for v in self._variables}
        duplicated = sorted({n for n in names if names.count(n) > 1})
        missing = sorted(expected - set(names))
        unknown = sorted(set(names) - expected)
        if duplicated or missing or unknown:
            raise InvalidArgument(
                "weights must name every trainable variable once: "
                f"missing {missing}, unknown {unknown}, duplicated {duplicated}"
            )
        specs = {v.name: v for v in self._variables}
        for name, dtype, shape in tensors:
            spec = specs[name]
            if tuple(shape) != spec.shape or np.dtype(dtype) != spec.dtype:
                raise InvalidArgument(
                    f"weights[{name!r}]: {np.dtype(dtype).name} {list(shape)}, "
                    f"variable is {spec.dtype.name} {list(spec.shape)}"
                )

    def replace(
        self, arrays: Mapping[str, np.ndarray], *, expected_version: int = 0, new_version: int = 0
    ) -> int:
        """Swap in new values for every variable at once; returns the new version.

        `new_version`, if given, must exceed the current one (replicas kept in step by
        one client all get the same version); else the version grows by one.
        """
        self.check([(name, array.dtype, array.shape) for name, array in arrays.items()])
        tensors = tuple(tf.constant(arrays[spec.name]) for spec in self._variables)
        with self._lock:
            current = self._current.version
            if expected_version and expected_version != current:
                raise FailedPrecondition(
                    f"expected version {expected_version}, but current is {current}; "
                    "another update came first"
                )
            if new_version and new_version <= current:
                raise FailedPrecondition(
                    f"new_version {new_version} does not exceed the current version {current}"
                )
            version = new_version or current + 1
            self._current = Snapshot(version, tensors)
            return version

    def arrays(self, snapshot: Snapshot) -> dict[str, np.ndarray]:
        return {
            spec.name: tensor.numpy()
            for spec, tensor in zip(self._variables, snapshot.trainable, strict=True)
        }
