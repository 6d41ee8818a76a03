"""Plant realistic bugs, one at a time, and check that the tests catch each (`make mutants`).

The repository's files (tracked and untracked, as `git ls-files` lists them) are copied to
a scratch directory; an import directory there maps `pergrad.*` onto the copy's folders as
pyproject.toml's package-dir does, and goes first on PYTHONPATH, so the tests (and the
servers they start) run the copy's code. The tests of every mutant first run on the
unchanged copy and must pass. Then each mutant's edits are made, its tests run, and the
mutant is reported killed, naming the tests that failed, or SURVIVED.

Each edit names its anchor, text that must occur exactly once in its file: when the code
changes so that an anchor is gone, the script stops before running anything and says which.

    python scripts/mutants.py [--keep] [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the dev extra's build tools bring tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Edit:
    path: str
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "loss_sum_over_time_steps",
        "a sequence's per-example loss sums its time steps instead of averaging them",
        (
            Edit(
                "server/engine/losses.py",
                "return tf.reduce_mean(values, axis=axes) if axes else values",
                "return tf.reduce_sum(values, axis=axes) if axes else values",
            ),
        ),
        ("tests/server/engine/test_engine.py", "tests/server/engine/test_losses.py"),
    ),
    Mutant(
        "clip_scale_off_by_1e-3",
        "the clipping scale (one formula, in the pass and in shared passes) uses "
        "max_norm * (1 + 1e-3)",
        (
            Edit(
                "server/engine/reductions/clipped_sum.py",
                "return ops.minimum(1.0, max_norm / ops.maximum(norms, TINY_NORM))",
                "return ops.minimum(1.0, max_norm * (1 + 1e-3) / ops.maximum(norms, TINY_NORM))",
            ),
        ),
        ("tests/server/engine/test_reductions.py", "tests/server/engine/test_group.py"),
    ),
    Mutant(
        "dense_bias_mean_over_steps",
        "Dense's per-example bias gradient averages over the steps instead of summing",
        (
            Edit(
                "server/engine/rules/dense.py",
                "grads[layer.bias.path] = tf.reduce_sum(g, axis=1)",
                "grads[layer.bias.path] = tf.reduce_mean(g, axis=1)",
            ),
        ),
        ("tests/server/engine/test_rules.py",),
    ),
    Mutant(
        "chunk_offset_one_element_early",
        "reassembly writes every chunk after a tensor's first one element early",
        (
            Edit(
                "wire/codec.py",
                "        target[filled:end] = data\n",
                "        shift = self._arrays[tensor].itemsize if filled else 0\n"
                "        target[filled - shift : end - shift] = data\n",
            ),
        ),
        ("tests/wire/test_codec.py",),
    ),
    Mutant(
        "weights_replaced_one_by_one",
        "SetWeights writes the variables one by one into the current snapshot, refusing a "
        "non-finite one when it reaches it",
        (
            Edit(
                "server/weights.py",
                "Snapshot(1, tuple(initial), ",
                "Snapshot(1, list(initial), ",
            ),
            Edit(
                "server/weights.py",
                "        if bad:\n"
                '            raise InvalidArgument(f"weights {bad} hold NaN or infinity; '
                'nothing was changed")\n',
                "",
            ),
            Edit(
                "server/weights.py",
                "            self._current = Snapshot(version, tensors, identity)\n"
                "            return self._current\n",
                "            for i, (tensor, array) in enumerate(zip(tensors, ordered)):\n"
                "                if not _finite(array):\n"
                '                    raise InvalidArgument(f"weights {bad} hold NaN or infinity")\n'
                "                current.trainable[i] = tensor\n"
                '            object.__setattr__(current, "version", version)\n'
                '            object.__setattr__(current, "weights_id", identity)\n'
                "            return current\n",
            ),
        ),
        ("tests/server/test_weights.py",),
    ),
    Mutant(
        "noise_seed_plus_one",
        "seeded noise comes from the stream of seed + 1",
        (
            Edit(
                "server/engine/reductions/clipped_sum.py",
                "keys = [stream_key(self._seed, v.index, NOISE_STREAM) for v in self._variables]",
                "keys = [stream_key(self._seed + 1, v.index, NOISE_STREAM) "
                "for v in self._variables]",
            ),
        ),
        ("tests/server/engine/test_reductions.py",),
    ),
    Mutant(
        "weights_id_without_names",
        "weights_id digests dtypes, shapes and bytes but not the variables' names",
        (
            Edit(
                "server/weights.py",
                'digest.update(f"{spec.name}:{spec.dtype.str}:{spec.shape};".encode())',
                'digest.update(f"{spec.dtype.str}:{spec.shape};".encode())',
            ),
        ),
        ("tests/server/test_weights.py",),
    ),
    Mutant(
        "int_cast_checks_only_the_upper_bound",
        "int64 values below int32's minimum wrap silently when cast",
        (
            Edit(
                "wire/casting.py",
                "if array.min() < limits.min or array.max() > limits.max:",
                "if array.max() > limits.max:",
            ),
        ),
        ("tests/wire/test_casting.py",),
    ),
    Mutant(
        "admission_released_only_on_success",
        "a call that ends early (cancelled, failed) keeps its admitted examples and bytes",
        (
            Edit(
                "server/admission/inflight.py",
                "        try:\n            yield\n        finally:\n",
                "        yield\n        if True:\n",
            ),
        ),
        ("tests/server/test_faults.py",),
    ),
    Mutant(
        "call_record_not_handed_to_the_servicer",
        "the servicer gets gRPC's bare context, not the call's record on it: refusals for "
        "content are never counted against their caller's budget",
        (
            Edit(
                "server/transport/guard.py",
                "served = context if call is None else calls.Context(context, call)",
                "served = context",
            ),
        ),
        (
            "tests/server/test_hostile_clients.py::"
            "test_a_caller_whose_refused_requests_pass_its_budget_is_refused_unread",
        ),
    ),
    Mutant(
        "unread_results_untimed",
        "a one-request method's responses are sent with no stall timer",
        (
            Edit(
                "server/transport/guard.py",
                "        return timed.responses(result, functools.partial(self._count, call))\n",
                "        return result\n",
            ),
        ),
        (
            "tests/server/test_hostile_clients.py::"
            "test_results_nobody_reads_are_cancelled_and_free_the_workers",
        ),
    ),
    Mutant(
        "gradient_norm_before_dividing",
        "a step reports the norm of 64 times the gradient it applied (a 64-example batch's "
        "sum, before dividing)",
        (
            Edit(
                "server/training.py",
                "squares = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in gradient]",
                "squares = [tf.reduce_sum(tf.square(64.0 * tf.cast(g, tf.float32))) "
                "for g in gradient]",
            ),
        ),
        ("tests/server/test_steps.py", "tests/server/test_training.py"),
    ),
    Mutant(
        "noise_keyed_by_selection_position",
        "seeded noise is keyed by a variable's position among those selected, not in the model",
        (
            Edit(
                "server/engine/reductions/clipped_sum.py",
                "keys = [stream_key(self._seed, v.index, NOISE_STREAM) for v in self._variables]",
                "keys = [stream_key(self._seed, i, NOISE_STREAM) "
                "for i, v in enumerate(self._variables)]",
            ),
        ),
        ("tests/server/engine/test_reductions.py",),
    ),
    Mutant(
        "step_ignores_its_weights_id_pin",
        "ApplyStep checks its version pin but not its weights_id",
        (
            Edit(
                "server/steps.py",
                "served.weights.get(request.model_version, request.weights_id)",
                "served.weights.get(request.model_version)",
            ),
        ),
        ("tests/server/test_steps.py",),
    ),
    Mutant(
        "split_step_ignores_expected_batch_size",
        "a step sent in parts (or over replicas) divides by the batch's size, not the "
        "caller's expected batch size",
        (
            Edit(
                "client/_steps.py",
                "step.expected_batch_size = step.expected_batch_size or result.batch_size",
                "step.expected_batch_size = result.batch_size",
            ),
        ),
        ("tests/server/test_steps.py",),
    ),
    Mutant(
        "nan_passes_assert_close",
        "the tests' comparison takes a NaN for a match (NaN > bound is False)",
        (Edit("tests/helpers.py", "if not error <= bounds[name]", "if error > bounds[name]"),),
        ("tests/test_helpers.py",),
    ),
    Mutant(
        "padding_by_zero_examples",
        "a padded pass grows by zero examples, whose NaN under a masked mean reaches sums",
        (
            Edit(
                "server/engine/compiled.py",
                "return np.concatenate([array, np.repeat(array[:1], size - count, axis=0)])",
                "return np.concatenate([array, np.zeros((size - count, *array.shape[1:]), "
                "array.dtype)])",
            ),
        ),
        ("tests/server/engine/test_zoo.py::test_family_matches_keras_oracle",),
    ),
    Mutant(
        "tied_cross_term_dropped",
        "a tied embedding's norm leaves out the inner product of its lookup and projection",
        (
            Edit(
                "server/engine/in_pass.py",
                "return squared_norms(grad.lookup) + squared_norms(grad.projection) + 2 * cross",
                "return squared_norms(grad.lookup) + squared_norms(grad.projection)",
            ),
        ),
        ("tests/server/engine/test_in_pass.py",),
    ),
    Mutant(
        "lora_factor_b_unscaled",
        "LoRA's B gradient leaves out alpha / rank",
        (
            Edit(
                "server/engine/rules/lora.py",
                "u = tf.reshape(tf.matmul(a, flat_a) * _scale(layer), [tf.shape(a)[0], -1, rank])",
                "u = tf.reshape(tf.matmul(a, flat_a), [tf.shape(a)[0], -1, rank])",
            ),
        ),
        ("tests/server/engine/test_rules.py",),
    ),
    Mutant(
        "fresh_optimizer_state_from_zeros",
        "a fresh optimizer state is built on zeros, not on the weights it starts from",
        (
            Edit(
                "server/training.py",
                "optimizer.build([keras.Variable(tf.identity(w)) for w in weights])",
                "optimizer.build([keras.Variable(tf.zeros_like(w)) for w in weights])",
            ),
        ),
        ("tests/server/test_training.py",),
    ),
    Mutant(
        "refused_budget_expires_a_second_early",
        "a caller's refused bytes leave the window a second early: one told to wait 8 s is "
        "let in after 7",
        (
            Edit(
                "server/admission/budgets.py",
                "while charges and charges[0][0] + 1 + (self.window_s or 0.0) <= now:",
                "while charges and charges[0][0] + (self.window_s or 0.0) <= now:",
            ),
        ),
        ("tests/server/admission/test_budgets.py",),
    ),
    Mutant(
        "worker_share_one_call_too_many",
        "a caller holds one place more than its share of a pool: with 2 workers one "
        "token computes on both and another token's call waits",
        (
            Edit(
                "server/admission/pools.py",
                "self._by_caller[caller] < cap",
                "self._by_caller[caller] <= cap",
            ),
        ),
        (
            "tests/server/test_hostile_clients.py::"
            "test_one_token_computes_on_half_of_the_workers_and_another_gets_the_rest",
        ),
    ),
    Mutant(
        "step_not_credited_its_own_request",
        "a step's own request bytes count against its caller's half of --max-inflight-bytes: "
        "a lone step is refused where the same batch's gradients call is served",
        (Edit("server/steps.py", "                held_bytes=held_bytes,\n", ""),),
        ("tests/server/test_steps.py",),
    ),
    Mutant(
        "request_that_fills_a_pass_left_out",
        "a request that exactly fills the room left in a shared pass is left out of it: "
        "32 + 32 examples take two passes of 64 instead of one",
        (
            Edit(
                "server/coalescer.py",
                "if pending.job.batch.size <= room:",
                "if pending.job.batch.size < room:",
            ),
        ),
        ("tests/server/test_coalescer.py",),
    ),
    Mutant(
        "float16_overflow_sent_as_infinity",
        "gradients past float16's range are sent as infinity with status OK",
        (Edit("server/gradients.py", "    if not np.isfinite(cast).all():\n", "    if False:\n"),),
        ("tests/server/test_gradients.py",),
    ),
    Mutant(
        "fresh_noise_under_a_fixed_key",
        "fresh noise's ChaCha20 key is not drawn from the OS for each call: every call's "
        "noise is the same, and anyone could regenerate it",
        (
            Edit(
                "server/engine/reductions/random_streams.py",
                "key, nonce = os.urandom(32), bytes(4) + os.urandom(12)",
                "key, nonce = bytes(32), bytes(16)",
            ),
        ),
        ("tests/server/engine/test_random_streams.py",),
    ),
    Mutant(
        "seeded_angle_left_unrounded",
        "the Gaussian rule's angle u2 * 2 pi reaches cos_sin unrounded: XLA fuses the "
        "product into t - node, and an entry near a zero of cos drifts 3 float32 ulps",
        (
            Edit(
                "server/engine/reductions/box_muller.py",
                "cos, sin = cos_sin(_rounded(u2 * (2.0 * np.pi), zero))",
                "cos, sin = cos_sin(u2 * (2.0 * np.pi))",
            ),
        ),
        ("tests/server/engine/test_random_streams.py",),
    ),
    Mutant(
        "fresh_noise_uniform_reaches_zero",
        "fresh noise's u1 is a 2^-53 instead of (a + 1) 2^-53: the smallest word gives "
        "u1 = 0, whose ln is -709, an entry of 37.7 past the bound of 8.57",
        (
            Edit(
                "server/engine/reductions/box_muller.py",
                "return (a + 1.0) * 2.0**-53, b * 2.0**-53",
                "return a * 2.0**-53, b * 2.0**-53",
            ),
        ),
        ("tests/server/engine/test_random_streams.py",),
    ),
    Mutant(
        "open_port_connections_unbounded",
        "the open services' own port sets no per-connection stream limit: one connection's "
        "silent health checks arrive in any number, and the refused ones churn the places",
        (
            Edit(
                "server/main.py",
                '        "grpc.max_concurrent_streams": limits.count("open_connection_calls"),\n',
                "",
            ),
        ),
        (
            "tests/server/test_hostile_clients.py::"
            "test_seventy_silent_health_checks_leave_a_probe_answering_on_the_shipped_layout",
        ),
    ),
)


def fail(message: str) -> SystemExit:
    return SystemExit(f"mutants: {message}")


def copy_repository(scratch: Path) -> None:
    """Every file git knows of or would add (tracked, or untracked and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is left out
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)


def package_dir(scratch: Path) -> dict[str, str]:
    """pyproject.toml's import name -> folder mapping, as setup.py reads it."""
    config = tomllib.loads((scratch / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def link_packages(scratch: Path) -> Path:
    """scratch/_import/pergrad: pyproject's package-dir as symlinks into the copy."""
    folders = package_dir(scratch)
    package = scratch / "_import" / "pergrad"
    package.mkdir(parents=True)
    for entry in (scratch / folders["pergrad"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in folders.items():
        if name != "pergrad":
            (package / name.removeprefix("pergrad.")).symlink_to(scratch / folder)
    return package.parent


def check_imports(scratch: Path, env: dict[str, str]) -> None:
    """Every pergrad package the tests import comes from the copy."""
    names = list(package_dir(scratch))
    code = f"import importlib\nfor n in {names!r}: print(importlib.import_module(n).__file__)"
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch, env=env, check=True, capture_output=True
    ).stdout.decode()
    outside = [path for path in found.split() if not Path(path).is_relative_to(scratch)]
    if outside:
        raise fail(f"the scratch run would import code outside the copy: {outside}")


def check_anchors(scratch: Path, mutants: tuple[Mutant, ...]) -> None:
    """Every anchor occurs exactly once in its file, else nothing runs."""
    missing = []
    for mutant in mutants:
        for edit in mutant.edits:
            count = (scratch / edit.path).read_text().count(edit.anchor)
            if count != 1:
                missing.append(f"{mutant.name}: {edit.path} holds {count} of {edit.anchor!r}")
    if missing:
        raise fail("anchors not found once (the code changed?):\n  " + "\n  ".join(missing))


def plant(scratch: Path, mutant: Mutant) -> dict[Path, str]:
    """Make the mutant's edits in order; returns the original text of every file edited."""
    originals: dict[Path, str] = {}
    for edit in mutant.edits:
        path = scratch / edit.path
        text = path.read_text()
        originals.setdefault(path, text)
        if text.count(edit.anchor) != 1:
            raise fail(f"{mutant.name}: anchor gone after its earlier edits: {edit.anchor!r}")
        path.write_text(text.replace(edit.anchor, edit.replacement))
    return originals


def failed_tests(report: Path) -> list[str]:
    """Test ids that failed or errored, from pytest's JUnit XML report."""
    failed = []
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    return failed


def run_tests(scratch: Path, env: dict[str, str], tests: tuple[str, ...]) -> list[str]:
    """Run `tests` in the copy; the ids of those that failed (pytest's own errors stop)."""
    report = scratch / "_report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, f"--junitxml={report}", *tests],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if done.returncode not in (0, 1):
        raise fail(f"pytest exited {done.returncode} on {tests}:\n{done.stdout[-3000:]}")
    failed = failed_tests(report)
    if (done.returncode == 1) != bool(failed):
        raise fail(f"pytest exited {done.returncode} but reported {failed}:\n{done.stdout[-3000:]}")
    return failed


def describe(failed: list[str], shown: int = 3) -> str:
    if not failed:
        return "SURVIVED"
    more = f" (+{len(failed) - shown} more)" if len(failed) > shown else ""
    return f"killed by {', '.join(failed[:shown])}{more}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - {m.name for m in MUTANTS})
    if unknown:
        raise fail(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}")
    mutants = tuple(m for m in MUTANTS if not args.names or m.name in args.names)

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="pergrad-mutants-")).resolve()
    try:
        copy_repository(scratch)
        check_anchors(scratch, mutants)
        imports = link_packages(scratch)
        env = {**os.environ, "PYTHONPATH": f"{imports}{os.pathsep}{scratch}"}
        check_imports(scratch, env)

        tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        failed = run_tests(scratch, env, tests)
        if failed:
            raise fail(f"the tests fail without any mutant: {failed}")
        print(f"baseline: {len(tests)} test files pass ({time.monotonic() - started:.0f} s)")

        survivors = []
        for mutant in mutants:
            began = time.monotonic()
            originals = plant(scratch, mutant)
            try:
                failed = run_tests(scratch, env, mutant.tests)
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            if not failed:
                survivors.append(mutant.name)
            took = time.monotonic() - began
            print(f"{mutant.name} ({mutant.bug}): {describe(failed)} [{took:.0f} s]", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{len(mutants) - len(survivors)} of {len(mutants)} mutants killed "
        f"in {time.monotonic() - started:.0f} s" + (f"; SURVIVED: {survivors}" if survivors else "")
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
