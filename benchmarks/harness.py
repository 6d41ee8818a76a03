"""Shared benchmark plumbing: interleaved timing with medians, peak memory in a child process."""

from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

SLOW_S = 5.0


def interleaved_medians(
    methods: dict[str, Callable[[], object]], *, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each method, the methods taking turns in every round.

    Each method runs once untimed first (tracing, allocation). A method whose timed call
    takes longer than SLOW_S is timed only once, to keep the run short.
    """
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            if times[name] and times[name][0] > SLOW_S:
                continue
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    """Start the peak-RSS count afresh (Linux: clear_refs 5 resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak RSS since the process started or `reset_peak_rss` (VmHWM). Not ru_maxrss: a
    child started by a large parent inherits the parent's ru_maxrss across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_child(
    script: Path, args: Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 900
) -> dict:
    """Run `script ARGS` in a fresh interpreter, which prints one JSON line last.

    A child killed by a signal (TensorFlow segfaults on some workloads) comes back as
    {"crashed": "<signal name>"} so the run goes on and the table says so.
    """
    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if run.returncode < 0:
        return {"crashed": signal.Signals(-run.returncode).name}
    if run.returncode != 0:
        raise RuntimeError(f"child {args} failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
