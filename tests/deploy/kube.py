"""Render the Kubernetes manifests (``kubectl kustomize``) and turn a rendered cluster into
the local processes its pods declare.

``render`` works on a copy of ``deploy/kubernetes`` with a throwaway cluster secret (the
repository holds none). ``local_pods`` reads every Deployment and StatefulSet replica's
container as a kubelet would: its command and args with ``$(VAR)`` expanded from its env,
``envFrom`` ConfigMaps, the downward API, and Secret volumes written to files. Only what
cannot exist on one host is mapped: each pod IP and Service name becomes 127.0.0.1, each
container port a free local port, each Secret volume's mount path a temporary directory,
and the ``pdserve`` program this checkout's ``python -m deploy.cli``.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.launch import free_ports
from tests.integration.cluster_harness import ROOT

KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(path.name for path in (KUBERNETES_DIR / "overlays").iterdir())
SECRET_FILE = Path("base") / "cluster-secret"
LOCALHOST = "127.0.0.1"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The kubectl binary (with kustomize built in); skips the test where there is none."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (.ci/run installs it): cannot render manifests")
    return found


def kustomize_tree(tmp_path: Path) -> Path:
    """A copy of deploy/kubernetes with a cluster secret file, ready to render."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, tree, ignore=shutil.ignore_patterns("cluster-secret"))
    (tree / SECRET_FILE).write_text("test-cluster-secret-not-for-production")
    return tree


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize directory``, as a list of resources."""
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments and StatefulSets."""
    return [doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")]


def component(doc: dict[str, Any]) -> str:
    """A resource's role label (proxy, prefill, decode, colocated)."""
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


@dataclass
class LocalPod:
    """One pod replica's container as a local process."""

    name: str
    component: str
    container: dict[str, Any]
    ports: dict[int, int]  # containerPort -> local port
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def port(self, name_or_number: str | int) -> int:
        """The local port of a container port, by name or number."""
        for declared in self.container.get("ports", []):
            if name_or_number in (declared["name"], declared["containerPort"]):
                return self.ports[declared["containerPort"]]
        raise KeyError(f"{self.name} declares no port {name_or_number!r}")

    def probe_url(self, probe: str) -> str:
        """The URL of the container's ``probe`` (readinessProbe, ...) on this host."""
        get = self.container[probe]["httpGet"]
        return f"http://{LOCALHOST}:{self.port(get['port'])}{get['path']}"

    @property
    def http_address(self) -> str:
        return f"{LOCALHOST}:{self.port('http')}"


def local_pods(docs: list[dict[str, Any]], secrets_dir: Path) -> list[LocalPod]:
    """Every replica of every workload in ``docs``, resolved to a local process."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs
                   if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: {k: base64.b64decode(v) for k, v in d["data"].items()}
               for d in docs if d["kind"] == "Secret"}
    placed: list[tuple[LocalPod, dict[str, Any]]] = []
    num_ports = sum(len(w["spec"]["template"]["spec"]["containers"][0].get("ports", []))
                    * w["spec"].get("replicas", 1) for w in workloads(docs))
    local_ports = iter(free_ports(num_ports))  # at once: no port handed out twice
    for workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        for index in range(workload["spec"].get("replicas", 1)):
            name = workload["metadata"]["name"]
            if workload["kind"] == "StatefulSet":
                name = f"{name}-{index}"
            numbers = [p["containerPort"] for p in container.get("ports", [])]
            ports = {number: next(local_ports) for number in numbers}
            placed.append((LocalPod(name, component(workload), container, ports), workload))
    pods = [pod for pod, _ in placed]
    services = _service_addresses(docs, pods)
    for pod, workload in placed:
        mounts = _secret_mounts(workload["spec"]["template"]["spec"], pod, secrets,
                                secrets_dir / pod.name)
        pod.env = _container_env(pod, config_maps, mounts, services)
        command = [*pod.container.get("command", []), *pod.container.get("args", [])]
        command = [_localise(_expand(arg, pod.env), pod, mounts, services) for arg in command]
        if command[0] == "pdserve":
            command = [sys.executable, "-m", "deploy.cli", *command[1:]]
        pod.argv = command
    return pods


def _service_addresses(docs: list[dict[str, Any]], pods: list[LocalPod]) -> dict[str, int]:
    """``{"service:port": local port}`` for every Service port that selects one pod."""
    by_label: dict[str, list[LocalPod]] = {}
    for pod in pods:
        by_label.setdefault(pod.component, []).append(pod)
    addresses = {}
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = by_label.get(service["spec"]["selector"]["app.kubernetes.io/component"], [])
        if len(selected) != 1:  # a worker role's governing Service: nothing calls through it
            continue
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            addresses[f"{service['metadata']['name']}:{port['port']}"] = selected[0].port(target)
    return addresses


def _secret_mounts(pod_spec: dict[str, Any], pod: LocalPod, secrets: dict[str, dict],
                   directory: Path) -> dict[str, str]:
    """Write each Secret volume the container mounts; ``{mount path: local directory}``."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = {}
    for mount in pod.container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue  # emptyDir (/dev/shm): nothing the process reads by path
        local = directory / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, value in secrets[volume["secret"]["secretName"]].items():
            (local / key).write_bytes(value)
        mounts[mount["mountPath"]] = str(local)
    return mounts


def _container_env(pod: LocalPod, config_maps: dict[str, dict], mounts: dict[str, str],
                   services: dict[str, int]) -> dict[str, str]:
    """The container's environment: envFrom first, then env (which wins), as the kubelet."""
    env: dict[str, str] = {}
    for source in pod.container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in pod.container.get("env", []):
        if "value" in var:
            value = _expand(var["value"], env)
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = LOCALHOST
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            value = pod.name
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            value = config_maps[ref["name"]][ref["key"]]
        env[var["name"]] = _localise(value, pod, mounts, services)
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion; an undefined variable stays as written."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _localise(text: str, pod: LocalPod, mounts: dict[str, str],
              services: dict[str, int]) -> str:
    """Map what only exists in a cluster to this host: Service addresses, the container's
    own ports, Secret mount paths."""
    for address, port in services.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(address)}(?!\d)", f"{LOCALHOST}:{port}", text)
    if text.isdigit() and int(text) in pod.ports:
        return str(pod.ports[int(text)])
    for mount_path, local in mounts.items():
        if text == mount_path or text.startswith(mount_path + "/"):
            return local + text[len(mount_path):]
    return text
