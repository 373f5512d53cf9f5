"""Offline validation of the Kubernetes deployment (deploy/helm/specdec-triton), no cluster needed.

- helm v4 (the real binary, deploy/tools/get_helm.py) lints the chart (--strict, values.schema.json) and
  renders it for both value sets (GPU production, CPU development);
- every built-in object is validated against the Kubernetes OpenAPI JSON schemas bundled in the
  `kubernetes-validate` package, strict mode (unknown fields are errors), at the oldest Kubernetes the
  chart declares (1.25) and the newest the package knows;
- the ServiceMonitor (a CRD) is validated against the prometheus-operator v0.80 CRD schema as generated into
  the `cloudcoil.models.prometheus_operator` pydantic models; a field the schema does not know fails too;
- cross-object wiring: selectors, named ports, the HPA's target and metric, the adapter rule behind it;
- the chart's model placement (`deployment:`) is rendered by the entrypoint: tests/deploy/test_deploy_entrypoint.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_helpers import CHART_DIR, REPO_ROOT, VALUE_SETS, helm_template

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSIONS = ["1.25", kubernetes_validate.utils.latest_version()]
VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
ADAPTER = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus-adapter" / "values.yaml").read_text())


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(helm: Path, name: str) -> None:
    cmd = [str(helm), "lint", "--strict", str(CHART_DIR)] + [f"--values={p}" for p in VALUE_SETS[name]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_values_schema_rejects_unsafe_or_mistyped_values(helm: Path) -> None:
    for bad in (
        "server.extraArgs[0]=--model-control-mode=explicit",  # the model-control API stays off
        "gpu.count=0",
        "autoscaling.metricName=Not A Metric",
        "unknownKey=1",
    ):
        with pytest.raises(AssertionError, match="helm template failed"):
            helm_template(helm, [], "--set", bad)


def test_rendered_objects(rendered) -> None:
    name, docs = rendered
    kinds = sorted(d["kind"] for d in docs)
    if name == "gpu":
        assert kinds == sorted(
            [
                "Deployment",
                "HorizontalPodAutoscaler",
                "PodDisruptionBudget",
                "Service",
                "Service",
                "ServiceAccount",
                "ServiceMonitor",
            ]
        )
    else:
        assert kinds == sorted(["Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceAccount"])


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_builtin_objects_match_kubernetes_schemas(rendered, k8s_version: str) -> None:
    _, docs = rendered
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: see test_servicemonitor_matches_crd_schema
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {path}: {exc.message} (Kubernetes {k8s_version})")
        checked += 1
    assert checked >= 5


def test_kubernetes_schema_check_catches_mistakes() -> None:
    """The validator is not a rubber stamp: a misspelt field and a wrong type fail."""
    good = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"name": "http", "port": 8000}]},
    }
    kubernetes_validate.validate(good, K8S_VERSIONS[0], strict=True)
    for bad_spec in ({"ports": [{"name": "http", "prot": 8000}]}, {"ports": [{"name": "http", "port": "eighty"}]}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate({**good, "spec": bad_spec}, K8S_VERSIONS[0], strict=True)


def _servicemonitor_model():
    try:
        from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
    except ImportError as exc:
        pytest.skip(f"cloudcoil.models.prometheus_operator is not installed: {exc}")
    return ServiceMonitor


def _validate_servicemonitor(doc: dict) -> None:
    """Schema check (types, patterns, required) plus no unknown field: the model drops what it does not know."""
    model = _servicemonitor_model().model_validate(doc)
    round_trip = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert round_trip == doc, f"fields unknown to the ServiceMonitor schema: {doc} -> {round_trip}"


def test_servicemonitor_matches_crd_schema(helm: Path) -> None:
    docs = helm_template(helm, [])
    monitor = one(docs, "ServiceMonitor")
    _validate_servicemonitor(monitor)
    # ... and the check bites.
    for broken in (
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "metrics", "interval": "15 seconds"}]}},
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "metrics", "intervall": "15s"}]}},
        {**monitor, "spec": {"endpoints": monitor["spec"]["endpoints"]}},  # no selector
    ):
        with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError or our round-trip assert
            _validate_servicemonitor(broken)


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_ports_and_targets_are_wired(rendered) -> None:
    _, docs = rendered
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    assert env["SPECDEC_OPENAI_PORT"] == "9000"  # docker/entrypoint.sh starts the OpenAI-compatible endpoint

    services = by_kind(docs, "Service")
    for service in services:
        assert _matches(service["spec"]["selector"], pod_labels)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, port
    main = next(s for s in services if s["spec"].get("clusterIP") != "None")
    assert {p["name"] for p in main["spec"]["ports"]} == {"http", "grpc", "metrics", "openai"}
    grpc = next(p for p in main["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"

    pdb = one(docs, "PodDisruptionBudget")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)

    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
        assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

    for monitor in by_kind(docs, "ServiceMonitor"):
        # Exactly one selected Service exposes the scraped port: every pod is scraped once, not twice.
        selected = [
            s for s in services if _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        for endpoint in monitor["spec"]["endpoints"]:
            exposing = [s for s in selected if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}]
            assert len(exposing) == 1, f"port {endpoint['port']} is exposed by {len(exposing)} selected Services"
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["llm"]

    configmaps = {c["metadata"]["name"] for c in by_kind(docs, "ConfigMap")}
    for volume in deployment["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in configmaps


def test_probes_use_triton_health_endpoints(rendered) -> None:
    _, docs = rendered
    spec = container(docs)
    assert spec["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert spec["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert spec["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # The startup probe covers a first start that builds TensorRT engines.
    startup = spec["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= (30 * 60 if spec["resources"]["limits"].get("nvidia.com/gpu") else 5 * 60)
    grace = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"]: e.get("value") for e in spec["env"]}
    sleep_s = int(spec["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert grace > sleep_s + int(env["SPECDEC_EXIT_TIMEOUT_S"]), "SIGKILL would cut the drain short"


def test_gpu_placement_and_resources(rendered) -> None:
    name, docs = rendered
    spec = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    requests, limits = spec["resources"]["requests"], spec["resources"]["limits"]
    assert "memory" in requests and "cpu" in requests and "memory" in limits
    if name == "gpu":
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    else:
        assert "nvidia.com/gpu" not in requests and "nvidia.com/gpu" not in limits
        assert "nodeSelector" not in pod and "tolerations" not in pod
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_gpu_count_value_reaches_requests_and_limits(helm: Path) -> None:
    docs = helm_template(
        helm, [], "--set", "gpu.count=4", "--set", "nodeSelector.nvidia\\.com/gpu\\.product=NVIDIA-H100"
    )
    resources = container(docs)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 4
    assert (
        one(docs, "Deployment")["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100"
    )


def test_safe_defaults(rendered) -> None:
    _, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    spec = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # No model-control API: the entrypoint sets --model-control-mode=none and nothing overrides it.
    assert not any("model-control" in arg for arg in spec.get("args", []))
    assert "--model-control-mode=none" in (REPO_ROOT / "docker" / "entrypoint.sh").read_text()
    # The only writable paths are volumes.
    mounts = {m["mountPath"] for m in spec["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts


def test_hpa_metric_is_served_by_the_adapter_rule(helm: Path) -> None:
    hpa = one(helm_template(helm, []), "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    rules = {rule["name"]["as"]: rule for rule in ADAPTER["rules"]["custom"]}
    assert metric["pods"]["metric"]["name"] in rules
    for rule in rules.values():
        series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
        assert re.search(rule["name"]["matches"], series), (rule["name"]["matches"], series)
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod values for a Pods metric
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]
        # Every selector of the query is scoped to the pod (label matchers) and grouped per pod.
        assert rule["metricsQuery"].count("{<<.LabelMatchers>>") == rule["metricsQuery"].count("{")
        assert rule["metricsQuery"].count("by (<<.GroupBy>>)") == rule["metricsQuery"].count("sum(")
        assert rule["metricsQuery"].count("(") == rule["metricsQuery"].count(")")
        assert series.startswith(("nv_inference_", "specdec_"))  # exported by the replicas: integration check


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_deployment_files_are_in_the_image(helm: Path, name: str) -> None:
    env = {e["name"]: e.get("value") for e in container(helm_template(helm, VALUE_SETS[name]))["env"]}
    in_repo = REPO_ROOT / Path(env["SPECDEC_DEPLOYMENT"]).relative_to("/opt/specdec")  # the images' SPECDEC_HOME
    assert in_repo.is_file(), f"{env['SPECDEC_DEPLOYMENT']} is not in the image: {in_repo} does not exist"
    assert "SPECDEC_DEPLOYMENT_OVERRIDES" not in env, "no overrides by default: the file as it is"


def test_deployment_overrides_reach_the_pod_and_roll_it(helm: Path) -> None:
    plain = helm_template(helm, [])
    docs = helm_template(helm, [], "--set", "deployment.models.draft_model.gpus[0]=1", "--set", "gpu.count=2")
    configmap = one(docs, "ConfigMap")
    assert yaml.safe_load(configmap["data"]["deployment-overrides.yaml"]) == {"models": {"draft_model": {"gpus": [1]}}}
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    assert env["SPECDEC_DEPLOYMENT_OVERRIDES"] == "/etc/specdec/deployment-overrides.yaml"
    pod = one(docs, "Deployment")["spec"]["template"]
    volume = next(v for v in pod["spec"]["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == "/etc/specdec" and mount["readOnly"] is True
    # A change of placement changes the pod template (checksum annotation): the Deployment rolls.
    assert "checksum/deployment" in pod["metadata"]["annotations"]
    assert "checksum/deployment" not in (
        one(plain, "Deployment")["spec"]["template"]["metadata"].get("annotations") or {}
    )
