"""Run by the installed interpreter: one gradients call per reduction named on the command
line, against TARGET; prints {reduction: {field: shape}} as JSON, refusing non-finite results.

    python every_reduction.py TARGET MODEL none norms ...
"""

from __future__ import annotations

import json
import sys

import numpy as np

from pergrad.client import GradientClient

# What each reduction needs to run; a reduction missing here fails the run.
OPTIONS = {
    "none": lambda info: {},
    "norms": lambda info: {},
    "clipped_sum": lambda info: {"max_norm": 1.0, "noise_multiplier": 1.0, "seed": 7},
    "moments": lambda info: {},
    "dot": lambda info: {
        "reference": {v.name: np.ones((2, *v.shape), np.float32) for v in info.variables}
    },
    "project": lambda info: {"dim": 16, "seed": 3},
}


def _shapes(value: object) -> object:
    if isinstance(value, dict):
        return {name: _shapes(v) for name, v in value.items()}
    array = np.asarray(value)
    if not np.isfinite(array).all():
        raise SystemExit(f"non-finite result: {array}")
    return list(array.shape)


def main(target: str, model: str, reductions: list[str]) -> None:
    rng = np.random.default_rng(0)
    with GradientClient(target, timeout=120) as client:
        info = client.model_info(model)
        x = rng.random((5, *info.input.shape[1:]))  # float64 and int64, numpy's defaults
        y = rng.integers(0, info.num_classes, 5)
        report = {}
        for reduction in reductions:
            result = client.per_example_gradients(
                model, x, y, reduction=reduction, **OPTIONS[reduction](info)
            )
            report[reduction] = _shapes({"losses": result.losses, **result.outputs})
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
