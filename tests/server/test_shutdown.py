"""Stopping a server leaves no process behind, even while its engine is still starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.integration.cluster_harness import alive, child_env, children_of

# Serves with an engine factory that never finishes starting (a model loading for minutes).
_SCRIPT = """
import sys
from engine_core.config import EngineConfig, ModelConfig
from engine_core.server.api_server import ServerOptions, run_server
from tests.server.test_shutdown import slow_engine_factory

run_server(EngineConfig(model=ModelConfig(model="unused")),
           ServerOptions(port=int(sys.argv[1]), log_stats_interval_s=0), slow_engine_factory)
"""


def slow_engine_factory(config: object) -> object:
    """Runs in the engine process: a model load that takes far longer than the test."""
    time.sleep(120)
    raise RuntimeError("not reached in the test")


def _engine_pids(pid: int) -> list[int]:
    """The spawned engine-core process(es) of ``pid`` (not multiprocessing's helpers)."""
    found = []
    for child in children_of(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_engine_startup_stops_the_engine_too(signum: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(free_port())], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not engines:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no engine process appeared"
            time.sleep(0.1)
            engines = _engine_pids(proc.pid)
        time.sleep(1.0)  # the engine is inside its (endless) startup now
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in engines if alive(pid)], \
            f"engine process left running after the server exited ({proc.returncode}):\n{output}"
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in engines:  # never leave the test's own orphan behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
