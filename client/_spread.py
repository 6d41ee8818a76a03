"""One call sent again when its replica dies; a batch split into micro-batches computed
concurrently (on several replicas) and merged in order; batches spread over replicas."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from pergrad.client._call import Call, request_examples
from pergrad.client._receive import read_results
from pergrad.client._retry import retried
from pergrad.client._types import (
    MixedPlansWarning,
    ModelInfo,
    PergradError,
    data_loss,
    from_rpc_error,
)
from pergrad.wire.casting import rows
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.results import GradientResult, merge


def computed(
    compute_call: Callable[..., Any],
    info: ModelInfo,
    call: Call,
    request: Whole,
    *,
    retries: int,
    out: GradientResult | None = None,
) -> GradientResult:
    """The result of one request, sent again while its replica is gone and retries remain
    (on several replicas, a request's retry goes to another one)."""
    expected = call.expected(info, request_examples(request))

    def send(left: float | None) -> list[GradientResult]:
        responses = compute_call(request, timeout=left)
        return [r for _, r in read_results(responses, lambda _: expected, out=out)]

    try:
        results = retried(send, retries, call.deadline)
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    if len(results) != 1:
        raise data_loss(f"{len(results)} results for one request")
    return results[0]


def check_versions(parts: list[GradientResult]) -> None:
    """Refuse a result assembled from different weights; warn (once per place, Python's
    default) of one assembled from replicas on different plans: its bits then depend on
    which replica computed which micro-batch."""
    if len({(p.model_version, p.weights_id) for p in parts}) > 1:
        seen = ", ".join(sorted({f"{p.server or '?'} v{p.model_version}" for p in parts}))
        raise PergradError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"micro-batches were computed with different weights versions ({seen}); "
            "pin model_version, or make every replica current with set_weights",
        )
    plans = {p.plan_id for p in parts}
    if len(plans) > 1:
        warnings.warn(
            f"micro-batches were computed by replicas on different plans {sorted(plans)} "
            "(XLA or not, layer routes): results agree only to float32 rounding; pin "
            "--jit-compile on every replica",
            MixedPlansWarning,
            stacklevel=4,
        )


def micro_batched(
    compute: Callable[[Call, Any, Any], GradientResult],
    pool: ThreadPoolExecutor,
    call: Call,
    x: Any,
    y: np.ndarray,
    size: int,
    *,
    out: GradientResult | None = None,
) -> GradientResult:
    """A batch as micro-batches of `size` computed at once, merged in order (into `out`'s
    arrays, if given); `x` one array, or one per model input."""
    futures = [
        pool.submit(compute, call.part(i), rows(x, part), y[part])
        for i, part in enumerate(part_slices(len(y), size))
    ]
    result = merged([f.result() for f in futures], into=out)
    if result.batch_size != len(y):
        raise data_loss(f"micro-batches hold {result.batch_size} examples of {len(y)}")
    return result


def merged(parts: list[GradientResult], *, into: GradientResult | None = None) -> GradientResult:
    """One batch's result from its parts' (`merge`), refused if their weights differ."""
    check_versions(parts)
    return merge(parts, into=into)


def part_slices(count: int, size: int) -> list[slice]:
    """The rows of each part of `count` examples, `size` at most in each (one part if none)."""
    return [slice(s, s + size) for s in range(0, count, size)] or [slice(None)]


def spread(
    pool: ThreadPoolExecutor,
    compute: Callable[[Any, Any], GradientResult],
    batches: Iterable[tuple[Any, Any]],
    max_in_flight: int,
) -> Iterator[GradientResult]:
    """Each batch its own call (round_robin spreads them), in order, `max_in_flight` at once."""
    pending: deque[Future[GradientResult]] = deque()
    try:
        for x, y in batches:
            pending.append(pool.submit(compute, x, y))
            if len(pending) >= max_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
