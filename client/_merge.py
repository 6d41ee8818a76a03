"""One batch's result from the results of its micro-batches, which replicas computed."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np

from pergrad.client._results import PER_VARIABLE, SINGLE
from pergrad.client._types import GradientResult, PergradError

# Fields that sum over examples; every other field has one row per example.
SUMMED = ("clipped_sum", "sum", "sum_squares", "num_clipped")


def check_versions(parts: Sequence[GradientResult]) -> None:
    """Refuse a result assembled from different weights versions."""
    if len({p.model_version for p in parts}) > 1:
        seen = ", ".join(sorted({f"{p.server or '?'} v{p.model_version}" for p in parts}))
        raise PergradError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"micro-batches were computed with different weights versions ({seen}); "
            "pin model_version, or make every replica current with set_weights",
        )


def merge(parts: Sequence[GradientResult]) -> GradientResult:
    check_versions(parts)
    fields: dict[str, object] = {}
    for name in SINGLE:
        values = [getattr(p, name) for p in parts]
        if values[0] is None:
            continue
        fields[name] = sum(values) if name in SUMMED else np.concatenate(values)
    for name in PER_VARIABLE:
        first = getattr(parts[0], name)
        if name in SUMMED:
            fields[name] = {k: sum(getattr(p, name)[k] for p in parts) for k in first}
        else:
            fields[name] = {k: np.concatenate([getattr(p, name)[k] for p in parts]) for k in first}
    servers = ",".join(dict.fromkeys(p.server for p in parts))
    return GradientResult(
        model_version=parts[0].model_version, model=parts[0].model, server=servers, **fields
    )
