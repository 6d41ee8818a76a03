"""Versioned weights: immutable snapshots swapped atomically.

A request takes one snapshot at its start and computes with it to the end, so an
update never tears a computation; an update validates everything before the swap,
so a rejected one changes nothing.

A snapshot also holds its optimizer's state (`pergrad.server.training`): a step makes
the next snapshot with the state it leaves, SetWeights one without (a fresh start).

Each snapshot has a version (1 at start, growing with every update, at most MAX_VERSION)
and a weights_id, a digest of its content: versions start again at 1 when a server
restarts, so a pin by version alone could meet other weights; a pin by id cannot.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from pergrad.server.engine import VariableSpec
from pergrad.server.engine.cores import on_cores
from pergrad.server.engine.grads import host
from pergrad.server.errors import FailedPrecondition, InvalidArgument

# Far below int64's limit, so that no version + 1 ever overflows the wire's int64.
MAX_VERSION = 1 << 62
# How far one update may move the version: no single SetWeights can bring a model near
# MAX_VERSION (2^30 such jumps would), so none can stop later updates.
MAX_VERSION_STEP = 1 << 32
# Bytes of a variable each digest of `weights_id` covers.
DIGEST_CHUNK = 4 << 20


@dataclass(frozen=True)
class Snapshot:
    version: int
    trainable: tuple[tf.Tensor, ...]
    weights_id: str
    optimizer_state: tuple[tf.Tensor, ...] | None = None  # None: the optimizer's fresh state


def weights_id(variables: Sequence[VariableSpec], arrays: Sequence[np.ndarray]) -> str:
    """A digest of every variable's name, dtype, shape and bytes, in model order: of each
    variable's header and the digests of its bytes' chunks (`_chunk_digests`)."""
    digest = hashlib.blake2b(digest_size=16)
    for spec, array in zip(variables, arrays, strict=True):
        digest.update(f"{spec.name}:{spec.dtype.str}:{spec.shape};".encode())
        digest.update(b"".join(_chunk_digests(np.ascontiguousarray(array).view(np.uint8))))
    return digest.hexdigest()


def _chunk_digests(data: np.ndarray) -> list[bytes]:
    """The digest of each DIGEST_CHUNK bytes of `data`, hashed on every core (hashlib lets
    go of the GIL): one blake2b stream over GPT-2's 55 MiB of weights took 60-80 ms here.
    SHA-256, which CPUs compute in hardware, hashes twice as fast here as blake2b."""
    chunks = range(0, max(1, data.size), DIGEST_CHUNK)
    out: list[bytes] = [b""] * len(chunks)

    def fill(part: slice) -> None:
        for k in range(part.start, part.stop):
            piece = data[chunks[k] : chunks[k] + DIGEST_CHUNK]
            out[k] = hashlib.sha256(piece.data).digest()

    on_cores(len(chunks), fill, serial=data.size < 2 * DIGEST_CHUNK)
    return out


class WeightsStore:
    """The current snapshot of one model's trainable variables, starting at version 1."""

    def __init__(self, variables: Sequence[VariableSpec], initial: Sequence[tf.Tensor]) -> None:
        self._variables = tuple(variables)
        self._lock = threading.Lock()
        arrays = [host(t) for t in initial]
        self._current = Snapshot(1, tuple(initial), weights_id(self._variables, arrays))

    @property
    def current(self) -> Snapshot:
        return self._current

    def get(self, version: int = 0, identity: str = "") -> Snapshot:
        """The current snapshot; with a non-zero `version` or a non-empty `identity`
        (weights_id), only if the current one is that."""
        snapshot = self._current
        if version and version != snapshot.version:
            raise FailedPrecondition(
                f"model_version {version} is not current (current is {snapshot.version}); "
                "fetch the current weights or pin the current version"
            )
        if identity and identity != snapshot.weights_id:
            raise FailedPrecondition(
                f"weights_id {identity} is not the current weights' ({snapshot.weights_id}): "
                "the server restarted or its weights were set since; fetch them again"
            )
        return snapshot

    def check_count(self, count: int) -> None:
        """Refuse more tensors than variables before any of them is read (a header may
        declare 60,000)."""
        if count > len(self._variables):
            names = [v.name for v in self._variables]
            raise InvalidArgument(
                f"weights name {count} tensors; the model has {len(names)} trainable "
                f"variables, to be named once each: {names}"
            )

    def check(self, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> None:
        """Refuse unless (name, dtype, shape) covers every variable exactly once."""
        names = [name for name, _, _ in tensors]
        expected = {v.name for v in self._variables}
        duplicated = sorted(name for name, count in Counter(names).items() if count > 1)
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
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        expected_version: int = 0,
        expected_id: str = "",
        new_version: int = 0,
    ) -> Snapshot:
        """Swap in new values for every variable at once; returns the new snapshot.

        `new_version`, if given, must exceed the current one by at most MAX_VERSION_STEP
        (replicas kept in step by one client all get the same version); else the version
        grows by one.
        """
        self.check([(name, array.dtype, array.shape) for name, array in arrays.items()])
        _check_new_version(new_version)
        ordered = [arrays[spec.name] for spec in self._variables]
        bad = [s.name for s, a in zip(self._variables, ordered, strict=True) if not _finite(a)]
        if bad:
            raise InvalidArgument(f"weights {bad} hold NaN or infinity; nothing was changed")
        tensors = tuple(tf.constant(array) for array in ordered)
        identity = weights_id(self._variables, ordered)
        with self._lock:
            version = _applied(self._current, expected_version, expected_id, new_version)
            self._current = Snapshot(version, tensors, identity)
            return self._current

    def check_update(
        self, *, expected_version: int = 0, expected_id: str = "", new_version: int = 0
    ) -> None:
        """Refuse, before its values are read, an update the current weights refuse
        already: its pins and version must hold when it arrives and at the swap
        (`replace`), so no upload is read in full only to be refused."""
        _check_new_version(new_version)
        _applied(self._current, expected_version, expected_id, new_version)

    def advance(
        self,
        step: Snapshot,
        trainable: Sequence[tf.Tensor],
        optimizer_state: Sequence[tf.Tensor],
        *,
        new_version: int = 0,
        finite: Sequence[bool] = (),
    ) -> Snapshot:
        """Make a step's result current, if `step` (the snapshot it started from) still
        is: with the optimizer's new state, all at once; returns the new snapshot.
        `finite`: whether each weight's values, then the state's, are all finite, as the
        step found them (else they are checked here)."""
        _check_new_version(new_version)
        arrays = [host(t) for t in trainable]
        finite = finite or [*map(_finite, arrays), all(_finite(host(t)) for t in optimizer_state)]
        bad = [s.name for s, ok in zip(self._variables, finite, strict=False) if not ok]
        if bad or not finite[-1]:
            what = f"weights {bad}" if bad else "the optimizer's state"
            raise FailedPrecondition(
                f"the step would make {what} NaN or infinite; nothing was changed "
                "(the gradient, or learning_rate times it, overflows float32)"
            )
        identity = weights_id(self._variables, arrays)
        with self._lock:
            current = self._current
            if current is not step:
                raise FailedPrecondition(
                    f"the weights changed during the step (version {step.version} became "
                    f"{current.version}: a SetWeights came first); nothing was applied"
                )
            version = _next(current, new_version)
            state = tuple(optimizer_state)
            self._current = Snapshot(version, tuple(trainable), identity, state)
            return self._current

    def arrays(self, snapshot: Snapshot) -> dict[str, np.ndarray]:
        return {
            spec.name: tensor.numpy()
            for spec, tensor in zip(self._variables, snapshot.trainable, strict=True)
        }


def _check_new_version(new_version: int) -> None:
    if not 0 <= new_version <= MAX_VERSION:
        raise InvalidArgument(f"new_version: must be in [0, 2^62], got {new_version}")


def _applied(current: Snapshot, expected_version: int, expected_id: str, new_version: int) -> int:
    """The version an update gets over `current`, if its compare-and-swap holds."""
    if expected_version and expected_version != current.version:
        raise FailedPrecondition(
            f"expected version {expected_version}, but current is {current.version}; "
            "another update came first"
        )
    if expected_id and expected_id != current.weights_id:
        raise FailedPrecondition(
            f"expected weights_id {expected_id}, but current is {current.weights_id}; "
            "another update came first, or the server restarted"
        )
    return _next(current, new_version)


def _next(current: Snapshot, new_version: int) -> int:
    """The version after `current`: `new_version` if given (checked), else one more."""
    if new_version and not 0 < new_version - current.version <= MAX_VERSION_STEP:
        raise FailedPrecondition(
            f"new_version {new_version} must exceed the current version "
            f"{current.version} by 1 to 2^32"
        )
    version = new_version or current.version + 1
    if version > MAX_VERSION:
        raise FailedPrecondition(f"version {current.version} is the last one (2^62)")
    return version


def _finite(array: np.ndarray) -> bool:
    return array.dtype.kind != "f" or bool(np.isfinite(array).all())
