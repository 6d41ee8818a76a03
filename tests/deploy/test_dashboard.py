"""The Grafana dashboard: importable, valid PromQL, and only metrics a server exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus import (
    ALERTS,
    DASHBOARD,
    all_names,
    metric_names,
    plain_promql,
    promtool,
    sample_names,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Metrics that exist only in some deployments: absent on a server without a GPU.
GPU_ONLY = {"pergrad_gpu_memory_used_bytes"}
# Prometheus' own series, not the server's.
PROMETHEUS_OWN = {"up"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def _rule_queries() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_dashboard_is_importable_with_a_prometheus_input_and_fixed_uid(dashboard) -> None:
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    assert dashboard["uid"] == "pergrad-overview"
    assert dashboard["id"] is None and dashboard["title"] == "pergrad"


def test_every_panel_and_variable_uses_the_input_datasource(dashboard) -> None:
    for panel in _panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE, variable["name"]


def test_panels_have_unique_ids_and_do_not_overlap(dashboard) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize(
    ("what", "metric", "needle"),
    [
        ("request rate by method", "grpc_server_handled_total", "by (grpc_method)"),
        ("errors by code", "grpc_server_handled_total", 'grpc_code!="OK"'),
        ("latency p50", "grpc_server_handling_seconds_bucket", "histogram_quantile(0.5,"),
        ("latency p95", "grpc_server_handling_seconds_bucket", "histogram_quantile(0.95,"),
        ("latency p99", "grpc_server_handling_seconds_bucket", "histogram_quantile(0.99,"),
        ("examples/s", "pergrad_examples_processed_total", "rate("),
        ("bytes/s", "pergrad_response_bytes_total", "rate("),
        ("queue time", "pergrad_request_queue_seconds_bucket", "histogram_quantile("),
        ("in flight", "pergrad_requests_in_flight", "pergrad_requests_in_flight"),
        ("calls refused unread", "pergrad_calls_refused_unread_total", "by (method)"),
        ("stalled calls", "pergrad_stalled_calls_total", "by (method)"),
        ("weights version per pod", "pergrad_weights_version", "by (pod, model)"),
        ("memory", "process_resident_memory_bytes", "by (pod)"),
    ],
)
def test_dashboard_shows(dashboard, what: str, metric: str, needle: str) -> None:
    assert any(metric in metric_names(q) and needle in q for q in _queries(dashboard)), what


def test_every_dashboard_query_is_valid_promql(dashboard, tmp_path: Path) -> None:
    """promtool parses each query as the expression of a recording rule."""
    rules = [
        {"record": f"pergrad:dashboard_query_{i}", "expr": plain_promql(q)}
        for i, q in enumerate(_queries(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, grpc_method) (rate(a_seconds_bucket{x="b c"}'
        "[$__rate_interval]))) / on (job) group_left sum(b_total offset 5m) > bool 1e3"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total"}


def test_every_metric_the_dashboard_and_alerts_query_is_exported(
    dashboard, exposition: str
) -> None:
    import tensorflow as tf

    queried = all_names(_queries(dashboard)) | all_names(_rule_queries())
    exempt = PROMETHEUS_OWN | (set() if tf.config.list_physical_devices("GPU") else GPU_ONLY)
    assert len(queried) > 10
    missing = queried - exempt - sample_names(exposition)
    assert not missing, f"queried but not exported: {sorted(missing)}"
