"""A real Prometheus on 127.0.0.1 scrapes a real server: the dashboard's queries answer.

Prometheus (Debian package `prometheus`) scrapes the server every second and evaluates the
alert rules; the test drives a few dozen calls with the real client, then asks Prometheus'
HTTP API for the dashboard's request-rate and p99-latency queries until they answer.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from pergrad.server.main import RunningServer
from tests.deploy.conftest import serve_some_traffic
from tests.prometheus import ALERTS, DASHBOARD, plain_promql, tool

WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, what: str, answer: Callable[[], Any]) -> Any:
        """The first truthy answer within WAIT_S seconds."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                if result := answer():
                    return result
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        pytest.fail(f"Prometheus never answered {what} within {WAIT_S:.0f} s")


@pytest.fixture(scope="module")
def prometheus(
    server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Prometheus]:
    """Prometheus scraping `server` as job "pergrad", with the alert rules loaded."""
    binary = tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "pergrad",
                "static_configs": [{"targets": [f"127.0.0.1:{server.metrics_port}"]}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{_free_port()}"
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={address}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = _Prometheus(f"http://{address}")
    try:
        api.wait_for("its first scrape", lambda: _scraped(api))
        yield api
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _scraped(api: _Prometheus) -> bool:
    return any(s["value"][1] == "1" for s in api.query('up{job="pergrad"}'))


def _dashboard_query(title: str, legend: str | None = None) -> str:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p["title"] == title]
    targets = [t for t in panel["targets"] if legend is None or t["legendFormat"] == legend]
    return plain_promql(targets[0]["expr"])


def _drive_load(server: RunningServer, seconds: float = 5.0) -> None:
    """A few dozen calls spread over several scrapes."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        serve_some_traffic(f"127.0.0.1:{server.port}", calls=4)
        time.sleep(0.1)


def test_dashboard_request_rate_and_p99_answer_from_real_prometheus(
    prometheus: _Prometheus, server: RunningServer, record_property: Callable[..., None]
) -> None:
    _drive_load(server)
    rate_expr = _dashboard_query("Request rate by method")
    p99_expr = _dashboard_query("Latency p50 / p95 / p99", legend="p99")

    def rates() -> dict[str, float]:
        series = prometheus.query(rate_expr)
        found = {s["metric"]["grpc_method"]: float(s["value"][1]) for s in series}
        return found if found.get("ComputePerExampleGradients", 0) > 0 else {}

    def p99() -> float:
        values = [float(s["value"][1]) for s in prometheus.query(p99_expr)]
        return values[0] if values and math.isfinite(values[0]) else 0.0

    by_method = prometheus.wait_for("the request rate", rates)
    latency = prometheus.wait_for("the p99 latency", p99)
    record_property("request_rate_per_s", by_method)
    record_property("p99_latency_s", latency)
    assert {"ComputePerExampleGradients", "StreamPerExampleGradients"} <= by_method.keys()
    assert 0 < by_method["ComputePerExampleGradients"] < 1000
    assert 0 < latency < 60


def test_alert_rules_load_and_evaluate_on_real_prometheus(prometheus: _Prometheus) -> None:
    expected = {
        rule["alert"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
    }

    def evaluated() -> dict[str, str]:
        groups = prometheus.get("/api/v1/rules")["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        done = all(r.get("lastEvaluation", "").startswith("20") for r in rules.values())
        return {name: rule["health"] for name, rule in rules.items()} if done and rules else {}

    health = prometheus.wait_for("evaluated rules", evaluated)
    assert health.keys() == expected
    assert set(health.values()) == {"ok"}, health
