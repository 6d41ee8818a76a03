"""One call's parameters and its reduction's options share the keywords of
`per_example_gradients` and `stream`: no option can take a call parameter's name; a
call's timeout is one deadline its parts share."""

from __future__ import annotations

import inspect

import pytest

from pergrad.client import GradientClient
from pergrad.client._call import Call
from pergrad.wire.catalogue import CALL_PARAMETERS, CATALOGUE, Catalogue
from pergrad.wire.terms import Option, Output, Reduction


def _named_parameters(function) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


@pytest.mark.parametrize(
    "function", [GradientClient.per_example_gradients, GradientClient.stream, Call.of]
)
def test_every_call_parameter_is_reserved(function) -> None:
    assert _named_parameters(function) - {"self", "cls"} <= CALL_PARAMETERS


def test_no_reduction_option_is_named_like_a_call_parameter() -> None:
    assert not {o.name for o in CATALOGUE.options()} & CALL_PARAMETERS


def test_a_reduction_with_an_option_named_like_a_call_parameter_is_refused() -> None:
    clash = Reduction(
        "clash",
        99,
        "an option that a call would swallow",
        options=(Option("timeout", "float", "seconds"),),
        outputs=(Output("norms", False, "example", ("B",), "norms"),),
    )
    with pytest.raises(ValueError, match=r"options \['timeout'\] would be call parameters"):
        Catalogue({"clash": clash})
    with pytest.raises(ValueError, match="would be call parameters"), CATALOGUE.extended(clash):
        pass
    assert "clash" not in CATALOGUE.names


def test_a_calls_parts_share_its_one_deadline() -> None:
    """A batch's micro-batches (and their retries) have what is left of the call's
    timeout, not a timeout each."""
    call = Call.of("m", reduction="clipped_sum", max_norm=1.0, noise_multiplier=1.0, timeout=30)
    left = call.time_left()
    assert left is not None and 0 < left <= 30
    assert {call.part(i).deadline for i in range(3)} == {call.deadline}


def test_a_call_without_a_timeout_has_no_deadline() -> None:
    assert Call.of("m").time_left() is None
