"""--lora: LoRA enabled on the served models at load, parsed before TensorFlow loads.

    --lora rank=4[,alpha=8][,targets=query+value][,train=head]

rank: the LoRA rank (0, or no --lora: off); alpha: Keras' lora_alpha (default the rank;
the update is scaled by alpha / rank); targets: the names of the layers that get LoRA
(default: each keras-hub backbone's own `default_lora_layer_names()`); train: the layers
whose variables train besides the LoRA factors (default: every layer outside the
keras-hub backbones, such as a classifier's head). Everything else is frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar


class LoraSpecError(ValueError):
    """A --lora that cannot be parsed; the message names the flag."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 0
    alpha: float | None = None  # None: the rank
    targets: tuple[str, ...] = ()  # empty: the keras-hub backbones' defaults
    train: tuple[str, ...] | None = None  # None: the layers outside the backbones

    def __bool__(self) -> bool:
        return self.rank > 0


_KEYS = ("rank", "alpha", "targets", "train")


def parse_lora(text: str) -> LoraSpec:
    """The spec of `--lora TEXT`; an empty text is LoRA off."""
    settings: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = (s.strip() for s in item.partition("="))
        if not equals or key not in _KEYS:
            raise LoraSpecError(
                f"--lora {text!r}: settings are key=value, comma-separated, keys {list(_KEYS)} "
                "(e.g. rank=4,alpha=8,targets=query+value,train=head)"
            )
        settings[key] = value
    if not settings:
        return LoraSpec()
    rank = _number(text, "rank", settings.get("rank", ""), int)
    alpha = settings.get("alpha")
    return LoraSpec(
        rank=rank,
        alpha=None if alpha is None else _number(text, "alpha", alpha, float),
        targets=_names(settings.get("targets", "")),
        train=None if "train" not in settings else _names(settings["train"]),
    )


Number = TypeVar("Number", int, float)


def _number(text: str, key: str, value: str, kind: Callable[[str], Number]) -> Number:
    try:
        number = kind(value)
    except ValueError:
        raise LoraSpecError(f"--lora {text!r}: {key} must be a number, got {value!r}") from None
    if not number > 0:
        raise LoraSpecError(f"--lora {text!r}: {key} must be positive, got {value!r}")
    return number


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split("+") if name.strip())
