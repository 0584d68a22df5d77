"""Stopping a server leaves no process behind, even while its engine is still starting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.launch import free_port
from tests.integration.cluster_harness import alive, child_env, children_of
from tests.server.conftest import kill_with_engines

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


@contextlib.contextmanager
def _server_inside_engine_startup() -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """The server process and its engine process(es), the engine inside its endless
    startup; on leaving, whatever is still running is killed (no orphan left behind)."""
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(free_port())], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not engines:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no engine process appeared"
            time.sleep(0.1)
            engines.extend(_engine_pids(proc.pid))
        time.sleep(1.0)  # the engine is inside its (endless) startup now
        yield proc, engines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in engines:  # never leave the test's own orphan behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The ``pids`` still alive after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_engine_startup_stops_the_engine_too(signum: int) -> None:
    with _server_inside_engine_startup() as (proc, engines):
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=30)
        assert not _wait_gone(engines, 10), \
            f"engine process left running after the server exited ({proc.returncode}):\n{output}"
        assert proc.returncode == 0, output


# Serves a real engine on the demo checkpoint whose steps take 0.2 s, with a short drain.
_DRAIN_SCRIPT = """
import sys
from engine_core.config import EngineConfig, ModelConfig
from engine_core.server.api_server import ServerOptions, run_server
from tests.server.test_shutdown import slow_step_engine_factory

run_server(EngineConfig(model=ModelConfig(model=sys.argv[2], max_model_len=256,
                                          served_model_name="demo")),
           ServerOptions(port=int(sys.argv[1]), log_stats_interval_s=0, shutdown_drain_s=2.0),
           slow_step_engine_factory)
"""


def slow_step_engine_factory(config: object) -> object:
    """Runs in the engine process: the real engine, 0.2 s a step (a long generation)."""
    from engine_core.engine_core import EngineCore

    class SlowSteps(EngineCore):
        def step(self):  # type: ignore[no-untyped-def]
            time.sleep(0.2)
            return super().step()

    return SlowSteps(config)  # type: ignore[arg-type]


def test_sigterm_drains_then_ends_the_remaining_streams_with_an_error(demo_checkpoint) -> None:
    """On SIGTERM the server refuses new requests, lets requests in flight finish for
    ``shutdown_drain_s`` (a short one completes), then ends the rest with an error event and
    [DONE] (not a cut connection), and exits 0 promptly with its engine gone."""
    import json
    import threading
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _DRAIN_SCRIPT, str(port), str(demo_checkpoint)],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[str]] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = json.dumps({"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            results[name] = [line.decode().strip() for line in response if line.strip()]

    engines: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.2)
        engines = _engine_pids(proc.pid)
        threads = [threading.Thread(target=stream, args=("short", 4)),
                   threading.Thread(target=stream, args=("long", 200))]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # both are in flight; the short one needs ~1 s more
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        output, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
        assert proc.returncode == 0, output
        assert elapsed < 15, f"shutdown took {elapsed:.1f} s:\n{output}"
        short, long = results["short"], results["long"]
        assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(
            short).replace(" ", ""), short
        assert long[-1] == "data: [DONE]", long[-3:]
        assert "shutting down" in long[-2] and '"error"' in long[-2], long[-3:]
        assert not _wait_gone(engines, 10), output
    finally:
        kill_with_engines(proc, engines)


def test_the_engine_dies_with_a_killed_api_process_even_inside_a_long_startup() -> None:
    """SIGKILL to the API process (a supervisor's last resort, an OOM kill): the engine child
    goes too at once, though it is inside a startup that would take minutes (the kernel's
    parent-death signal; the engine's own parent check runs only between steps)."""
    with _server_inside_engine_startup() as (proc, engines):
        proc.kill()
        proc.communicate(timeout=30)
        assert not _wait_gone(engines, 5), "the engine outlived its API process"
