"""The catalogue and the wire contract agree; options are checked by their declarations."""

from __future__ import annotations

import re

import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import CATALOGUE, OptionError
from pergrad.wire.terms import Output, Reduction
from tests.conftest import ROOT

PROTO = (ROOT / "protos/pergrad/v1/gradient_service.proto").read_text()
REQUEST_FIELDS = pb.GradientsRequest.DESCRIPTOR.fields_by_name


def test_every_enum_value_has_one_entry_of_the_same_name() -> None:
    entries = {r.number: r.name for r in CATALOGUE.reductions.values()}
    enum = {
        number: name.removeprefix("REDUCTION_").lower() for name, number in pb.Reduction.items()
    }
    assert entries == enum


def test_every_option_is_a_request_field_of_its_kind() -> None:
    for option in CATALOGUE.options():
        field = REQUEST_FIELDS[option.field]
        if option.kind == "choice":
            values = {v.name for v in field.enum_type.values}
            assert {option.enum_prefix + c.upper() for c in option.choices} <= values
        elif option.kind == "tensors":
            assert field.message_type.GetOptions().map_entry
        else:
            assert field.has_presence, f"{option.name}: an unset value must be told apart"


def test_an_option_name_has_one_declaration_across_reductions() -> None:
    """One name, one meaning: type, field, default, bounds and help all agree (the CLI
    prints one help per flag)."""
    for option in CATALOGUE.options():
        same = [
            o for r in CATALOGUE.reductions.values() for o in r.options if o.name == option.name
        ]
        assert all(o == option for o in same), option.name


def test_option_names_are_their_proto_fields() -> None:
    """Error messages name an option as the request's field a proto reader knows."""
    for option in CATALOGUE.options():
        assert option.field == option.name


def test_the_protos_reduction_comment_names_every_output() -> None:
    comment = PROTO[
        PROTO.index("// Reductions computed on the server") : PROTO.index("enum Reduction")
    ]
    for reduction in CATALOGUE.reductions.values():
        line = re.search(rf"//\s+{reduction.name.upper()}\s+(.*)", comment)
        assert line, reduction.name
        block = comment[line.start() :]
        for output in reduction.outputs:
            assert output.field in block, (reduction.name, output.field)


@pytest.mark.parametrize(
    ("reduction", "options", "message"),
    [
        ("clipped_sum", {}, "max_norm: clipped_sum needs a finite positive bound"),
        ("clipped_sum", {"max_norm": 0.0}, "got 0.0"),
        ("clipped_sum", {"max_norm": True}, "got True"),
        ("clipped_sum", {"max_norm": 1, "seed": -1}, "0 <= seed <= 18446744073709551615"),
        ("project", {"dim": 70000}, "1 <= dim <= 65536, got 70000"),
        ("project", {"dim": 2.5}, "got 2.5"),
        ("project", {"dim": 4, "projection": "uniform"}, "unknown projection 'uniform'"),
        ("norms", {"dim": 4}, "dim applies to project"),
        ("dot", {}, "reference: dot needs"),
    ],
)
def test_bad_options_are_refused_naming_the_option(reduction, options, message) -> None:
    with pytest.raises(OptionError, match=re.escape(message)):
        CATALOGUE.check_options(CATALOGUE.get(reduction), options)


def test_defaults_are_filled_in() -> None:
    checked = CATALOGUE.check_options(CATALOGUE.get("project"), {"dim": 8})
    assert checked == {"dim": 8, "seed": None, "projection": "rademacher"}
    checked = CATALOGUE.check_options(CATALOGUE.get("clipped_sum"), {"max_norm": 2})
    assert checked == {"max_norm": 2.0, "noise_multiplier": 0.0, "seed": None}


def test_options_checked_once_pass_the_catalogue_as_they_are() -> None:
    entry = CATALOGUE.get("clipped_sum")
    checked = CATALOGUE.check_options(entry, {"max_norm": 2})
    assert CATALOGUE.check_options(entry, checked) is checked
    assert CATALOGUE.check_options(CATALOGUE.get("norms"), {}) is not checked


def test_an_extended_reductions_outputs_are_known_while_it_is_in() -> None:
    scores = Output("scores", False, "example", ("B",), "a score per example")
    extra = Reduction("extra", 98, "a reduction for one block", outputs=(scores,))
    with CATALOGUE.extended(extra):
        assert CATALOGUE.output("scores") == scores
    with pytest.raises(KeyError):
        CATALOGUE.output("scores")
