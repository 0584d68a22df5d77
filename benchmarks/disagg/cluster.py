"""Start one report topology with ``python -m deploy.launch``, find its workers, stop it.

The launcher owns the proxy and the workers (GPU pinning, ports, readiness, SIGTERM-first
teardown); this class only runs it as a child in its own session and reads the proxy's
``/instances`` to learn the workers' addresses.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.disagg.plan import Topology
from deploy.launch import free_port
from deploy.supervisor import die_with_parent

logger = logging.getLogger("pdserve.report")

HOST = "127.0.0.1"


# Flags every benchmark cluster's launcher gets. Benchmark requests carry no grammar, and a
# worker's timed grammar-engine import (about 1 s holding the API process's GIL, 10 s after
# its start) would land in the first run's latencies.
BENCH_LAUNCH_FLAGS = ("--grammar-import-delay", "inf")


class ClusterError(RuntimeError):
    """A topology did not come up."""


def _get_json(url: str, timeout_s: float = 3.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass
class ClusterSpec:
    """How every topology of a report is launched."""

    model: str
    served_model_name: str
    engine_args: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()       # empty: CPU
    log_dir: Path = Path(".")
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 60.0
    # every worker's --kv-cache-memory-bytes, unless --engine-args or its topology set one
    # (None: sized from memory)
    kv_cache_bytes: int | None = None


@dataclass
class Cluster:
    """One running topology: ``with Cluster(spec, topology) as c: c.url, c.worker_url(...)``."""

    spec: ClusterSpec
    topology: Topology
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return f"http://{HOST}:{self.port}"

    def argv(self) -> list[str]:
        """The launcher's command line."""
        t, spec = self.topology, self.spec
        argv = [sys.executable, "-m", "deploy.launch", "--prefill", str(t.prefill),
                "--decode", str(t.decode), "--colocated", str(t.colocated),
                "--port", str(self.port), "--model", spec.model,
                "--served-model-name", spec.served_model_name,
                "--log-dir", str(spec.log_dir / t.name), "--heartbeat-interval", "1",
                "--stop-timeout", str(spec.stop_timeout_s / 2),
                "--startup-timeout", str(spec.startup_timeout_s), *BENCH_LAUNCH_FLAGS,
                "--enable-prefix-caching" if t.prefix_caching else "--no-enable-prefix-caching"]
        # The last flag wins: the spec's default, then --engine-args, then the topology's own.
        if spec.kv_cache_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
        argv += spec.engine_args
        if t.kv_cache_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(t.kv_cache_bytes)]
        if t.kv_offload_gib > 0:
            argv += ["--kv-offloading-size", f"{t.kv_offload_gib:g}"]
        argv.append("--first-token-from-prefill" if t.first_token_from_prefill
                    else "--no-first-token-from-prefill")
        if t.routing != "round_robin":
            argv += ["--routing", t.routing]
        if t.prefill_overflow:
            argv += ["--prefill-overflow", str(t.prefill_overflow)]
        if spec.gpus:
            if len(spec.gpus) < t.num_workers:
                raise ClusterError(f"{t.name} needs {t.num_workers} GPUs, have {spec.gpus}")
            argv += ["--gpus", ",".join(spec.gpus[:t.num_workers])]
        return argv

    def start(self) -> None:
        """Start the launcher and wait until every worker is registered and healthy."""
        log_dir = self.spec.log_dir / self.topology.name
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "launch.log", "ab") as log:
            # Own session (we signal the whole group), but dies with us: a report killed by a
            # time limit must not leave workers holding the GPUs.
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        logger.info("launching %s (pid %d): logs in %s", self.topology.name, self.proc.pid,
                    log_dir)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ClusterError(f"{self.topology.name}: launcher exited with "
                                   f"{self.proc.returncode}; see {log_dir}")
            if self._ready():
                logger.info("%s ready at %s", self.topology.name, self.url)
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.topology.name} not ready after "
                                   f"{self.spec.startup_timeout_s:.0f}s; see {log_dir}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            workers = _get_json(f"{self.url}/instances")["workers"]
            if len(workers) < self.topology.num_workers:
                return False
            for worker in workers:
                with urllib.request.urlopen(f"http://{worker['http_address']}/health",
                                            timeout=3.0) as response:
                    if response.status != 200:
                        return False
        except Exception:  # not up yet: connection refused, 503, a half-written answer
            return False
        self.workers = workers
        return True

    def problems(self) -> list[str]:
        """What is wrong with the topology now: its launcher gone, or a worker it started with
        no longer registered (a prefill worker whose engine died deregisters, and the proxy
        then serves its requests another way: such a run measures another topology)."""
        if self.proc is None or self.proc.poll() is not None:
            return ["the launcher exited"]
        try:
            now = {w["http_address"] for w in _get_json(f"{self.url}/instances")["workers"]}
        except Exception as exc:  # the proxy itself is down or hung
            return [f"proxy /instances: {exc}"]
        lost = sorted(f"{w['role']} {w['http_address']}" for w in self.workers
                      if w["http_address"] not in now)
        return [f"workers no longer registered: {', '.join(lost)}"] if lost else []

    def worker_urls(self, role: str | None = None) -> list[str]:
        """Base URLs of the workers (of one proxy role: P, D, colocated)."""
        return [f"http://{w['http_address']}" for w in self.workers
                if role is None or w["role"] == role]

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its children), SIGKILL its group after a deadline."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.spec.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop; killing it", self.topology.name)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
