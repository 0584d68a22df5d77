"""``benchmarks.disagg.cluster.Cluster.problems``: a report never publishes a run of a
topology that broke under it (a worker gone from the proxy's registry: the proxy then
serves its requests another way, so the run measures another topology).

The proxy is a stand-in serving ``/instances``; the workers leaving a real proxy's
registry (deregistered on SIGTERM, expired after SIGKILL) is tested with real processes in
tests/deploy/test_kubernetes_cpu_cluster.py and tests/integration/test_prefill_kill.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks.disagg.cluster import Cluster, ClusterSpec
from benchmarks.disagg.plan import PD

P = {"role": "P", "http_address": "127.0.0.1:8101"}
D = {"role": "D", "http_address": "127.0.0.1:8102"}


class _Instances:
    """A proxy stand-in whose ``/instances`` lists ``workers``."""

    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = [P, D]
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = json.dumps({"workers": outer.workers}).encode()
                self.send_response(200 if self.path == "/instances" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy() -> Iterator[_Instances]:
    instances = _Instances()
    yield instances
    instances.close()


@pytest.fixture
def launcher() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_lost_worker_is_a_problem_until_the_launcher_or_proxy_is(
        proxy: _Instances, launcher: subprocess.Popen, tmp_path: Any) -> None:
    spec = ClusterSpec(model="m", served_model_name="m", log_dir=tmp_path)
    cluster = Cluster(spec, PD, port=proxy.port, proc=launcher, workers=[P, D])
    assert cluster.problems() == []

    proxy.workers = [D]  # P's engine died: it left the registry
    assert cluster.problems() == ["workers no longer registered: P 127.0.0.1:8101"]
    proxy.workers = []
    assert cluster.problems() == [
        "workers no longer registered: D 127.0.0.1:8102, P 127.0.0.1:8101"]
    proxy.workers = [P, D, {"role": "D", "http_address": "127.0.0.1:8103"}]
    assert cluster.problems() == []  # a worker more is not one lost

    proxy.close()  # the proxy itself is gone
    (problem,) = cluster.problems()
    assert problem.startswith("proxy /instances: ")

    launcher.kill()
    launcher.wait()
    assert cluster.problems() == ["the launcher exited"]
    assert Cluster(spec, PD, port=proxy.port).problems() == ["the launcher exited"]  # none
