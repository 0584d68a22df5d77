"""What the CPU overlay declares is what runs: its rendered pods, started as local processes
with exactly their commands, arguments and environment (``tests.deploy.kube``), serve
greedy output equal to a colocated server through the proxy; and a SIGTERM to a worker
under load (what a scale-down or rolling update sends) loses no request and leaves no KV
held."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.deploy.kube import LocalPod, kustomize_tree, local_pods, render
from tests.integration.cluster_harness import (
    ROOT,
    STARTUP_S,
    Outcome,
    Req,
    check_matches,
    get_json,
    idle_violations,
    mixed_requests,
    run_all,
    scrape,
    wait_http,
    wait_idle,
    with_limit,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SERVED_MODEL = "pdserve-demo"  # the CPU overlay's SERVED_MODEL_NAME
DRAINED = "Drained: no request in flight, every KV block free"
# Flags of a P/D worker that a colocated server of the same engine flags does not take.
_WORKER_ONLY_FLAGS = ("--kv-port", "--proxy-address", "--kv-transfer-config")


@dataclass
class Running:
    """A started pod (or the colocated reference server) and its log."""

    pod: LocalPod
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text()[-4000:]


@dataclass
class CpuCluster:
    proxy: Running
    prefill: Running
    decode: Running
    colocated_url: str
    url: str


def _start(pod: LocalPod, log: Path) -> Running:
    """Start ``pod``'s process with only its declared environment (and this checkout's
    import path, as the image's installed package)."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONPATH": str(ROOT), **pod.env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(pod.argv, env=env, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    return Running(pod, proc, log)


def _colocated_of(worker: LocalPod) -> LocalPod:
    """A colocated ``pdserve serve`` with the worker's engine flags, on a free port."""
    argv, rest = worker.argv[:3] + ["serve"], worker.argv[4:]
    skip = False
    for arg in rest:
        if skip:
            skip = False
            continue
        if arg in _WORKER_ONLY_FLAGS:
            skip = True
            continue
        if arg == "--port":
            argv += ["--port", str(free_port())]
            skip = True
            continue
        argv.append(arg)
    return replace(worker, name="colocated-reference", argv=argv)


def _stop(running: list[Running]) -> None:
    for run in running:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for run in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(max(0.1, deadline - time.monotonic()))
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.fixture(scope="module")
def cpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuCluster]:
    tmp = tmp_path_factory.mktemp("cpu-overlay")
    docs = render(kustomize_tree(tmp) / "overlays" / "cpu")
    pods = {pod.component: pod for pod in local_pods(docs, tmp / "secrets")}
    assert sorted(pods) == ["decode", "prefill", "proxy"]
    for pod in pods.values():
        assert not any("$(" in arg for arg in pod.argv), pod.argv  # every variable defined
        assert all(str(port) in pod.argv for port in pod.ports.values()), (pod.ports, pod.argv)
    started = [_start(pods[name], tmp / f"{name}.log") for name in ("proxy", "prefill",
                                                                      "decode")]
    colocated = _start(_colocated_of(pods["decode"]), tmp / "colocated.log")
    started.append(colocated)
    try:
        deadline = time.monotonic() + STARTUP_S
        procs, logs = [r.proc for r in started], [r.log for r in started]
        colocated_port = colocated.pod.argv[colocated.pod.argv.index("--port") + 1]
        wait_http(f"http://127.0.0.1:{colocated_port}/health", deadline, procs, logs)
        for run in started[:3]:  # ready as the kubelet's readiness probe sees it
            wait_http(run.pod.probe_url("readinessProbe"), deadline, procs, logs)
        proxy, prefill, decode = started[:3]
        yield CpuCluster(proxy, prefill, decode, f"http://127.0.0.1:{colocated_port}",
                         f"http://{proxy.pod.http_address}")
    finally:
        _stop(started)


def _requests(n: int, max_tokens: int = 12, offset: int = 0) -> list[Req]:
    return [replace(r, body={**r.body, "model": SERVED_MODEL})
            for r in mixed_requests(n, max_tokens=max_tokens, offset=offset)]


def _registered(cluster: CpuCluster) -> dict[str, dict]:
    return {w["role"]: w for w in get_json(f"{cluster.url}/instances")["workers"]}


def test_the_cpu_overlay_serves_colocated_greedy_output(cpu_cluster: CpuCluster) -> None:
    """Workers advertise their pod IP (downward API) for HTTP and KV, found the proxy by its
    Service name, and the P/D path gives the colocated server's tokens."""
    workers = _registered(cpu_cluster)
    for role, run in (("P", cpu_cluster.prefill), ("D", cpu_cluster.decode)):
        assert workers[role]["http_address"] == run.pod.http_address
        assert workers[role]["zmq_address"] == f"127.0.0.1:{run.pod.port('kv')}"
    reqs = _requests(16)
    check_matches(reqs, run_all(cpu_cluster.url, reqs), run_all(cpu_cluster.colocated_url, reqs))


def _load_in_background(url: str, reqs: list[Req], concurrency: int
                        ) -> tuple[threading.Thread, list[list[Outcome]]]:
    results: list[list[Outcome]] = []
    thread = threading.Thread(target=lambda: results.append(run_all(url, reqs, concurrency)))
    thread.start()
    return thread, results


def _sigterm_and_wait_drained(run: Running, timeout_s: float) -> None:
    """SIGTERM (a pod deleted); the worker exits 0 once drained, with every KV block free."""
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout_s) == 0, run.output()
    assert DRAINED in run.log.read_text(), run.output()


def test_sigterm_to_a_worker_under_load_loses_no_request_and_holds_no_kv(
        cpu_cluster: CpuCluster) -> None:
    drain_s = float(cpu_cluster.prefill.pod.env["SHUTDOWN_TIMEOUT"])
    # The prefill worker leaves while requests stream through it: those it took finish and
    # their KV reaches the decode worker; the rest are served without it.
    reqs = _requests(24, offset=100)
    want = run_all(cpu_cluster.colocated_url, reqs)
    thread, results = _load_in_background(cpu_cluster.url, reqs, concurrency=6)
    prefill = cpu_cluster.prefill.pod.http_address
    deadline = time.monotonic() + 60
    while scrape(prefill).get("vllm:prompt_tokens_total", 0.0) == 0:
        assert thread.is_alive() and time.monotonic() < deadline, cpu_cluster.prefill.output()
        time.sleep(0.05)
    _sigterm_and_wait_drained(cpu_cluster.prefill, drain_s + 15)
    assert "P" not in _registered(cpu_cluster)  # deregistered, not expired
    thread.join(120)
    check_matches(reqs, results[0], want)
    decode = cpu_cluster.decode.pod.http_address
    assert idle_violations(wait_idle([decode], 30)) == []

    # The decode worker leaves with streams in flight on it: every one of them completes.
    # What they still generate after the SIGTERM must fit the drain (SHUTDOWN_TIMEOUT) with
    # room for a 2-core box several times oversubscribed: 16 tokens each.
    reqs = [with_limit(r, 16, stream=True) for r in _requests(6, offset=200)]
    want = run_all(cpu_cluster.colocated_url, reqs)
    thread, results = _load_in_background(cpu_cluster.url, reqs, concurrency=len(reqs))
    deadline = time.monotonic() + 60
    while scrape(decode).get("vllm:num_requests_running", 0.0) < len(reqs):
        assert thread.is_alive() and time.monotonic() < deadline, cpu_cluster.decode.output()
        time.sleep(0.05)
    _sigterm_and_wait_drained(cpu_cluster.decode, drain_s + 15)
    thread.join(120)
    check_matches(reqs, results[0], want)
