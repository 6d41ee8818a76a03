"""--optimizer: a Keras optimizer's name and settings, parsed before TensorFlow loads;
whether Keras has them is checked before any model loads (`pergrad.server.training`).

    --optimizer sgd | sgd:momentum=0.9,nesterov=true | adam:beta_2=0.99
"""

from __future__ import annotations

from dataclasses import dataclass


class OptimizerSpecError(ValueError):
    """An --optimizer that cannot be parsed; the message names the flag."""


@dataclass(frozen=True)
class OptimizerSpec:
    text: str
    name: str
    options: tuple[tuple[str, float | int | bool], ...]


def parse_optimizer(text: str) -> OptimizerSpec:
    name, _, rest = text.partition(":")
    options = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier():
            raise OptimizerSpecError(
                f"--optimizer {text!r}: settings are key=value, comma-separated "
                "(e.g. sgd:momentum=0.9,nesterov=true)"
            )
        options.append((key.strip(), _setting(text, value.strip())))
    if not name.strip().isidentifier():
        raise OptimizerSpecError(f"--optimizer {text!r}: begins with an optimizer's name, e.g. sgd")
    return OptimizerSpec(text, name.strip().lower(), tuple(options))


def _setting(text: str, value: str) -> float | int | bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise OptimizerSpecError(f"--optimizer {text!r}: {value!r} is not a number, true or false")
