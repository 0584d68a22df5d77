"""deploy/kubernetes: every overlay renders and validates against the Kubernetes schemas
offline (strict: an unknown field fails), and every workload has the probes, resource
requests, disruption budget, anti-affinity, scrape annotations and cluster secret a
production deployment needs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from deploy.cli import build_parser
from engine_core.cluster.trust import ClusterSecret
from engine_core.cluster.trust_flags import cluster_secret_from_args
from engine_core.config import KVTransferConfig
from engine_core.server.server_args import apply_environment
from tests.deploy.kube import (
    OVERLAYS,
    component,
    kustomize_tree,
    local_pods,
    render,
    workloads,
)

# The oldest Kubernetes the manifests support and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
WORKER_ROLES = ("prefill", "decode", "colocated", "worker")
GPU_OVERLAYS = tuple(name for name in OVERLAYS if name != "cpu")
SECRET_ENV = "PDSERVE_CLUSTER_SECRET_FILE"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tree = kustomize_tree(tmp_path_factory.mktemp("kube"))
    return {name: render(tree / "overlays" / name) for name in OVERLAYS}


def schema_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Each resource that fails strict validation against a supported Kubernetes version."""
    errors = []
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except (kubernetes_validate.ValidationError,
                    kubernetes_validate.SchemaNotFoundError) as exc:
                message = getattr(exc, "message", str(exc)).splitlines()[0]
                errors.append(f"{doc['kind']}/{doc['metadata']['name']} ({version}): {message}")
    return errors


def _probe_path(container: dict[str, Any], probe: str) -> str | None:
    return (container.get(probe) or {}).get("httpGet", {}).get("path")


def deployment_problems(docs: list[dict[str, Any]], gpu: bool) -> list[str]:
    """What a workload lacks: probes on the right endpoints, CPU and memory (and, with
    ``gpu``, GPU) requests, a disruption budget and anti-affinity per worker role, scrape
    annotations, the mounted cluster secret."""
    problems = []
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for workload in workloads(docs):
        name, role = workload["metadata"]["name"], component(workload)
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        requests = container.get("resources", {}).get("requests", {})
        for resource in ("cpu", "memory", *(("nvidia.com/gpu",) if gpu and role != "proxy"
                                             else ())):
            if resource not in requests:
                problems.append(f"{name}: no {resource} request")
        wanted = {"readinessProbe": "/ready", "livenessProbe": "/health"}
        if role != "proxy":
            wanted["startupProbe"] = "/health"
        for probe, path in wanted.items():
            if _probe_path(container, probe) != path:
                problems.append(f"{name}: {probe} is not GET {path}")
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true" or \
                annotations.get("prometheus.io/path") != "/metrics":
            problems.append(f"{name}: no Prometheus scrape annotations")
        env = {var["name"]: var.get("value") for var in container.get("env", [])}
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        if not any((env.get(SECRET_ENV) or "").startswith(m + "/") for m in mounts):
            problems.append(f"{name}: {SECRET_ENV} names no mounted file")
        if role in WORKER_ROLES:
            labels = workload["spec"]["selector"]["matchLabels"]
            if not any(b["spec"]["selector"]["matchLabels"] == labels for b in budgets):
                problems.append(f"{name}: no PodDisruptionBudget")
            terms = spec.get("affinity", {}).get("podAntiAffinity", {}).get(
                "preferredDuringSchedulingIgnoredDuringExecution", [])
            if not any(t["podAffinityTerm"]["labelSelector"]["matchLabels"] == labels
                       for t in terms):
                problems.append(f"{name}: no anti-affinity among its role's pods")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(rendered: dict, overlay: str) -> None:
    docs = rendered[overlay]
    assert {component(w) for w in workloads(docs)} >= {"proxy"}
    assert schema_errors(docs) == []
    assert deployment_problems(docs, gpu=overlay in GPU_OVERLAYS) == []


def test_overlays_run_the_roles_they_name(rendered: dict) -> None:
    def replicas(overlay: str) -> dict[str, int]:
        return {component(w): w["spec"].get("replicas", 1) for w in workloads(rendered[overlay])}

    assert replicas("1p1d") == {"proxy": 1, "prefill": 1, "decode": 1}
    assert replicas("xpyd") == {"proxy": 1, "prefill": 2, "decode": 4}
    assert replicas("colocated") == {"proxy": 1, "colocated": 4}
    assert replicas("workers") == {"proxy": 1, "worker": 4}
    assert replicas("cpu") == {"proxy": 1, "prefill": 1, "decode": 1}
    for workload in workloads(rendered["cpu"]):
        for part in ("requests", "limits"):
            assert "nvidia.com/gpu" not in workload["spec"]["template"]["spec"][
                "containers"][0]["resources"].get(part, {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_command_parses_as_pdserve_flags(rendered: dict, overlay: str,
                                                        tmp_path: Path) -> None:
    """What the GPU overlays run is checked too, not only the CPU one the cluster test
    starts: every variable is defined, the flags are pdserve's and the KV config parses."""
    for pod in local_pods(rendered[overlay], tmp_path):
        assert pod.argv[1:3] == ["-m", "deploy.cli"], pod.argv  # the `pdserve` program
        assert not any("$(" in arg for arg in pod.argv), pod.argv
        args = build_parser().parse_args(pod.argv[3:])
        assert args.command == {"proxy": "proxy", "prefill": "prefill", "decode": "decode",
                                "colocated": "serve", "worker": "worker"}[pod.component]
        if pod.component in ("prefill", "decode", "worker"):
            kv = KVTransferConfig.from_json(args.kv_transfer_config)
            assert kv.kv_ip == kv.http_ip == "127.0.0.1"  # the pod IP, from the downward API
            assert kv.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer",
                                  "worker": "kv_both"}[pod.component]


def test_placed_workers_bound_their_steps_to_the_proxys_target(rendered: dict,
                                                               tmp_path: Path) -> None:
    """The workers overlay's step target is what launch derives from the proxy's TPOT
    target (``PlacementConfig.decode_step_target_s``)."""
    from proxy.placement import PlacementConfig

    pods = {pod.component: build_parser().parse_args(pod.argv[3:])
            for pod in local_pods(rendered["workers"], tmp_path)}
    planned_s = PlacementConfig(slo_tpot_s=pods["proxy"].slo_tpot_ms / 1e3).decode_step_target_s
    assert pods["worker"].decode_step_target_ms == pytest.approx(planned_s * 1e3)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_process_loads_the_mounted_cluster_secret(rendered: dict, overlay: str,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifests name the secret only in PDSERVE_CLUSTER_SECRET_FILE: every entry point
    folds it into --cluster-secret-file and loads the Secret's bytes, so no pod binds its
    pod IP without a secret (which it refuses to do)."""
    secret = ClusterSecret(b"test-cluster-secret-not-for-production")  # kube.kustomize_tree's
    for pod in local_pods(rendered[overlay], tmp_path):
        args = build_parser().parse_args(pod.argv[3:])
        assert args.cluster_secret_file is None, pod.argv  # not on the command line
        monkeypatch.setenv(SECRET_ENV, pod.env[SECRET_ENV])
        apply_environment(args)
        assert args.cluster_secret_file == pod.env[SECRET_ENV]
        assert cluster_secret_from_args(args) == secret, pod.name


def test_the_checks_fail_on_an_unknown_field_a_missing_probe_or_request(rendered: dict) -> None:
    docs = rendered["1p1d"]
    decode = next(d for d in docs if d["kind"] == "StatefulSet"
                  and component(d) == "decode")

    def broken(change: Any) -> list[dict[str, Any]]:
        copied = copy.deepcopy(docs)
        change(next(d for d in copied if d["metadata"]["name"] == decode["metadata"]["name"]
                    and d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0])
        return copied

    unknown = broken(lambda c: c.update(readinessProbes=c["readinessProbe"]))
    assert any("readinessProbes" in e for e in schema_errors(unknown))
    no_probe = broken(lambda c: c.pop("readinessProbe"))
    assert deployment_problems(no_probe, gpu=True) == [
        "pdserve-decode: readinessProbe is not GET /ready"]
    no_gpu = broken(lambda c: c["resources"]["requests"].pop("nvidia.com/gpu"))
    assert deployment_problems(no_gpu, gpu=True) == ["pdserve-decode: no nvidia.com/gpu request"]
    numeric_arg = broken(lambda c: c["args"].append(8000))  # args are strings
    assert schema_errors(numeric_arg)


def test_servicemonitor_is_an_optional_component_over_a_base_that_needs_no_crd(
        tmp_path: Path) -> None:
    """The base validates without the Prometheus Operator; with the component, the
    ServiceMonitor selects the proxy and worker Services by their `http` port."""
    tree = kustomize_tree(tmp_path)
    base = render(tree / "base")
    assert schema_errors(base) == []
    overlay = tree / "overlays" / "with-monitor"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../1p1d]\ncomponents: [../../components/servicemonitor]\n")
    docs = render(overlay)
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert schema_errors([d for d in docs if d is not monitor]) == []
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    scraped = {s["metadata"]["name"] for s in docs if s["kind"] == "Service"
               and selector.items() <= s["metadata"]["labels"].items()
               and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])}
    assert scraped == {"pdserve-proxy", "pdserve-prefill", "pdserve-decode"}
    assert endpoint["path"] == "/metrics"
