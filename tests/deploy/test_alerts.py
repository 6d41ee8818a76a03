"""The Prometheus alert rules: promtool-clean, covering what on-call needs, well labelled."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.prometheus import ALERTS, metric_names, promtool


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def test_alert_rules_pass_promtool_check_rules() -> None:
    run = promtool("check", "rules", str(ALERTS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@pytest.mark.parametrize(
    ("alert", "metric", "needle"),
    [
        ("PergradHighErrorRatio", "grpc_server_handled_total", "grpc_code=~"),
        ("PergradHighLatencyP99", "grpc_server_handling_seconds_bucket", "histogram_quantile(0.99"),
        ("PergradReplicaDown", "up", "== 0"),
        ("PergradAllReplicasDown", "up", "absent("),
        ("PergradQueueTimeGrowing", "pergrad_request_queue_seconds_sum", "deriv("),
    ],
)
def test_alerts_cover(rules, alert: str, metric: str, needle: str) -> None:
    expr = rules[alert]["expr"]
    assert metric in metric_names(expr) and needle in expr


def test_every_alert_has_a_severity_summary_and_description(rules) -> None:
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_every_alert_selects_the_pergrad_job(rules) -> None:
    for name, rule in rules.items():
        assert 'job="pergrad"' in rule["expr"], name
