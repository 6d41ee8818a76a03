"""Helpers for tests that read metrics: scrape /metrics, parse it, name a query's metrics."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import installed_tool

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pergrad-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "pergrad-alerts.yaml"

# Values for the dashboard's template variables that make its queries plain PromQL
# matching any series of a server scraped as job "pergrad".
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": ".*",
    "$job": "pergrad",
    "$pod": ".*",
    "$model": ".*",
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "by", "without", "on", "ignoring"}
_KEYWORDS |= {"group_left", "group_right", "inf", "nan", "atan2"}


def scrape(port: int, host: str = "127.0.0.1") -> str:
    """The text exposition a server's metrics endpoint answers."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def sample_names(exposition: str) -> set[str]:
    """Every series name in an exposition (histograms give _bucket, _sum and _count)."""
    return {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def sample_value(exposition: str, name: str, **labels: str) -> float | None:
    """The value of the series `name` whose labels include `labels`, if one is exported."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


def metric_names(expr: str) -> set[str]:
    """Names of the metrics a PromQL expression selects (not functions or keywords)."""
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = _GROUPING.sub(" ", expr)
    return {
        match.group(1)
        for match in _IDENTIFIER.finditer(expr)
        if not match.group(2) and match.group(1).lower() not in _KEYWORDS
    }


def plain_promql(expr: str) -> str:
    """A dashboard query with its Grafana variables replaced by plain values."""
    for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def tool(name: str) -> str:
    """Path of prometheus or promtool; the test fails, saying how to get it, without it."""
    return installed_tool(name, "Debian package 'prometheus' (`make system-deps` installs it)")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def all_names(exprs: Iterable[str]) -> set[str]:
    return set().union(*(metric_names(e) for e in exprs))
