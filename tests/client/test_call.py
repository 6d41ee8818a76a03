"""One call's parameters and its reduction's options share the keywords of
`per_example_gradients` and `stream`: no option can take a call parameter's name."""

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
