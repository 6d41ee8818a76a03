"""The table of limits: every bound resolved from the flags, shown as it is in the
operator's docs, and exported by a running server."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

from pergrad.server.admission.limits import LIMITS, markdown, resolve, share
from pergrad.server.config import Config, add_arguments
from pergrad.server.main import RunningServer
from tests.conftest import ROOT
from tests.prometheus import sample_value, scrape


def test_every_limit_resolves_to_a_positive_capacity_under_the_defaults() -> None:
    capacities = resolve(replace(Config(), max_request_bytes=4 << 20))
    assert list(capacities) == [limit.name for limit in LIMITS]
    assert all(capacity > 0 for capacity in capacities.values())


def test_a_callers_share_is_half_and_never_none() -> None:
    assert [share(n) for n in (1, 2, 3, 16)] == [1, 1, 1, 8]


def test_the_operators_docs_show_the_table_as_it_is() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    assert markdown() in text, "docs/operations.md: paste limits.markdown() in place of its table"


def test_every_flag_a_limit_names_is_a_serve_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    named = {flag for limit in LIMITS for flag in re.findall(r"--[a-z-]+", limit.set_by)}
    assert named and named <= flags


def test_a_running_server_exports_each_limits_capacity(server: RunningServer) -> None:
    exposition = scrape(server.metrics_port)
    exported = {
        limit.name: sample_value(exposition, "pergrad_limit", limit=limit.name) for limit in LIMITS
    }
    assert exported == {name: float(value) for name, value in server.limits.items()}
