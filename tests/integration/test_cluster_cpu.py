"""Real 1P1D and 2P2D clusters on CPU (`python -m deploy.launch`) give colocated greedy output
(the session's colocated server's answers, ``reference``, are the reference for both)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.integration.cluster_harness import (
    ENGINE_ARGS,
    ROOT,
    STARTUP_S,
    Reference,
    alive,
    check_matches,
    child_env,
    children_of,
    run_all,
    wait_http,
)

NUM_REQUESTS = 64  # mixed: completions and chat, streaming and not, all concurrent


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("num_prefill,num_decode,kill_decode", [(1, 1, False), (2, 2, True)],
                         ids=["1P1D", "2P2D"])
def test_cluster_matches_colocated(reference: Reference, tmp_path: Path, num_prefill: int,
                                   num_decode: int, kill_decode: bool) -> None:
    """Both shapes serve the reference's answers, move every prompt's KV over the
    connector, and leave no process behind after a SIGTERM to the launcher. The 2P2D one
    also SIGKILLs a decode worker: the launcher restarts it (its engine process exits too),
    it rejoins beside the other D, and the answers are the same after (the launcher's
    restart does not depend on the shape, so one shape pays for that worker start)."""
    reqs, want = reference.first(NUM_REQUESTS)
    proxy_port = free_port()
    launch_log = tmp_path / "launch.log"
    with open(launch_log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--prefill", str(num_prefill),
             "--decode", str(num_decode), "--model", str(reference.checkpoint),
             "--port", str(proxy_port), "--log-dir", str(tmp_path / "logs"),
             "--heartbeat-interval", "1", "--stop-timeout", "10", "--restart", *ENGINE_ARGS],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while f"ready: {num_prefill}P{num_decode}D" not in launch_log.read_text():
            assert launcher.poll() is None, launch_log.read_text()[-4000:]
            assert time.monotonic() < deadline, launch_log.read_text()[-4000:]
            time.sleep(0.1)

        proxy = f"http://127.0.0.1:{proxy_port}"
        check_matches(reqs, run_all(proxy, reqs), want)

        orphans: list[int] = []
        if kill_decode:
            # A decode worker that dies is reported and restarted, and serves again.
            first_pid = int(re.findall(r"decode0 \(pid (\d+)\)", launch_log.read_text())[0])
            orphans = children_of(first_pid)  # its engine process must notice and exit too
            assert orphans
            os.kill(first_pid, signal.SIGKILL)
            deadline = time.monotonic() + STARTUP_S
            while len(re.findall(r"started decode0 \(pid (\d+)\)",
                                 launch_log.read_text())) < 2:
                assert time.monotonic() < deadline, launch_log.read_text()[-4000:]
                time.sleep(0.1)
            assert f"decode0 (pid {first_pid}) died" in launch_log.read_text()
            decode = [w["http_address"] for w in json.load(urllib.request.urlopen(
                f"{proxy}/instances", timeout=5))["workers"] if w["role"] == "D"]
            assert len(decode) == num_decode, decode
            for address in decode:
                wait_http(f"http://{address}/health", deadline, [launcher], [launch_log])
            time.sleep(1.5)  # one heartbeat: the proxy has seen the restarted worker
            check_matches(reqs, run_all(proxy, reqs), want)

        # The KV came over the connector: no D ever fell back to recomputing a prompt.
        for index in range(num_decode):
            decode_log = (tmp_path / "logs" / f"decode{index}.log").read_text()
            assert "recomputing the prompt locally" not in decode_log, decode_log[-4000:]
            assert "kv load" not in decode_log, decode_log[-4000:]

        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", launch_log.read_text())]
        pids = [p for p in pids if alive(p)]
        assert len(pids) == 1 + num_prefill + num_decode, launch_log.read_text()
        pids += [c for pid in pids for c in children_of(pid)]  # the workers' engine processes
        assert len(pids) >= 1 + 2 * (num_prefill + num_decode), pids
        pids += orphans
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=40)
        assert launcher.returncode == 0, launch_log.read_text()[-4000:]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], launch_log.read_text()[-4000:]
        assert "stopped" in launch_log.read_text()
    finally:
        if launcher.poll() is None:  # SIGTERM first: the launcher stops its children
            launcher.terminate()
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
