"""The chaos soak's cluster: the launched topology plus a second proxy, started, killed,
restarted and sampled (memory, /metrics) by ``benchmarks.chaos_soak``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy.launch import Child, add_launch_arguments, build_children, engine_argv, free_ports
from deploy.supervisor import stop_all
from engine_core.server.metrics import CONNECTOR_GAUGES, CONNECTOR_TRANSIENT_GAUGES

ENGINE_IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:kv_cache_usage_perc")
# Short transfer deadlines, so a transfer from a killed P fails (and is recomputed) quickly.
SOAK_KV_EXTRA = {"get_lease_s": 5, "transfer_timeout_s": 5, "orphan_ttl_s": 5}


@dataclass
class ClusterSettings:
    """The topology (``pdserve launch`` arguments) and how the cluster is run."""

    launch_argv: list[str]
    log_dir: Path
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 2.0


def _children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def held_kv(scraped: dict[str, float]) -> list[str]:
    """The idle gauges of one worker that do not read 0."""
    names = [*ENGINE_IDLE_GAUGES]
    if any(name.startswith("pdserve:kv_transfer_") for name in scraped):
        names += [f"pdserve:kv_transfer_{key}" for key in CONNECTOR_GAUGES
                  if key not in CONNECTOR_TRANSIENT_GAUGES]
    return [f"{name}={scraped.get(name)}" for name in names if scraped.get(name) != 0.0]


@dataclass
class MemoryTrack:
    """RSS of one process of the latest incarnation of a child: first and last sample."""

    first_mb: float | None = None
    last_mb: float | None = None
    peak_mb: float = 0.0

    def sample(self, rss_mb: float | None) -> None:
        if rss_mb is None:
            return
        self.first_mb = rss_mb if self.first_mb is None else self.first_mb
        self.last_mb, self.peak_mb = rss_mb, max(self.peak_mb, rss_mb)


@dataclass
class SoakCluster:
    """The launched topology plus proxy B; starts, kills, restarts and samples them."""

    proxy_a: Child
    proxy_b: Child
    workers: list[Child]
    url_a: str
    url_b: str
    memory: dict[str, MemoryTrack] = field(default_factory=dict)

    @classmethod
    def build(cls, settings: ClusterSettings) -> SoakCluster:
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        parser = argparse.ArgumentParser(prog="chaos_soak --")
        add_launch_arguments(parser)
        port_a, reg_a, port_b, reg_b = free_ports(4)
        args = parser.parse_args([*settings.launch_argv, "--port", str(port_a),
                                  "--registration-port", str(reg_a),
                                  "--heartbeat-interval", str(settings.heartbeat_s)])
        proxy_a, workers, url_a = build_children(args, engine_argv(args), settings.log_dir)
        proxy_a.argv += ["--heartbeat-timeout", str(settings.heartbeat_timeout_s)]
        argv_b = list(proxy_a.argv)
        argv_b[argv_b.index("--port") + 1] = str(port_b)
        argv_b[argv_b.index("--registration-port") + 1] = str(reg_b)
        proxy_b = Child("proxy_b", argv_b, proxy_a.env, settings.log_dir / "proxy_b.log")
        for worker in workers:  # both proxies, short transfer deadlines
            if "--kv-transfer-config" in worker.argv:
                index = worker.argv.index("--kv-transfer-config") + 1
                kv = json.loads(worker.argv[index])
                kv["kv_connector_extra_config"].update(
                    {**SOAK_KV_EXTRA, "proxy_addresses": [f"127.0.0.1:{reg_b}"]})
                worker.argv[index] = json.dumps(kv)
        return cls(proxy_a, proxy_b, workers, url_a, url_b=f"http://127.0.0.1:{port_b}")

    @property
    def children(self) -> list[Child]:
        return [self.proxy_a, self.proxy_b, *self.workers]

    def start(self, deadline_s: float) -> None:
        for child in self.children:
            child.start()
        for child in self.children:
            self.wait_serving(child, deadline_s)

    def wait_serving(self, child: Child, deadline_s: float,
                     down: Callable[[], set[str]] = set) -> None:
        """Until ``child`` (a new incarnation: its memory is tracked anew) answers /health
        and, a worker, both proxies list it, or, proxy B, it lists every worker not ``down``
        (the names of those being restarted)."""
        deadline = time.monotonic() + deadline_s
        url = {self.proxy_a.name: self.url_a, self.proxy_b.name: self.url_b}.get(
            child.name, f"http://{child.http_address}")
        while True:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited: see {child.log_path}")
            want = ({w.http_address for w in self.workers if w.name not in down()}
                    if child is self.proxy_b else
                    set() if child is self.proxy_a else {child.http_address})
            try:
                http_get(f"{url}/health", 2.0)
                if want <= self._registered(self.url_a) and want <= self._registered(self.url_b):
                    self._sample(child, fresh=True)
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not serving within {deadline_s:.0f} s")
            time.sleep(0.2)

    @staticmethod
    def _registered(url: str) -> set[str]:
        workers = json.loads(http_get(f"{url}/instances", 2.0))["workers"]
        return {w["http_address"] for w in workers}

    def _sample(self, child: Child, fresh: bool = False) -> None:
        if child.proc is None:
            return
        for role, pid in (("api", child.proc.pid),
                          *(("engine", p) for p in _children_of(child.proc.pid))):
            key = f"{child.name}/{role}"
            if fresh or key not in self.memory:
                self.memory[key] = MemoryTrack()
            self.memory[key].sample(_rss_mb(pid))

    def sample_all(self) -> None:
        for child in self.children:
            self._sample(child)

    def victims(self, kind: str) -> list[Child]:
        """The children a kill of ``kind`` may hit (placed workers serve every role)."""
        if kind == "proxy":
            return [self.proxy_b]
        role = "prefill" if kind == "prefill" else "decode"
        return [w for w in self.workers if w.name.startswith((role, "worker", "colocated"))]

    def kill(self, kind: str, child: Child) -> None:
        """SIGKILL ``child`` (its engine process only, for ``engine``) and wait for it."""
        assert child.proc is not None
        if kind == "engine":
            for pid in _children_of(child.proc.pid):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=60)  # the API process exits after its engine; if
                # it does not, the requests judge it, and its group is killed below
        child.kill_group()
        child.proc.wait(timeout=60)
        if child.log is not None:
            child.log.close()

    def stop(self) -> None:
        stop_all([c for c in self.children if c.proc is not None], 20.0)
