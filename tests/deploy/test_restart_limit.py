"""``pdserve launch --restart`` is bounded: a child that needs more than ``--max-restarts``
restarts within ``--restart-window`` makes the launcher stop everything and exit 1.

Unbounded, a worker that can never come up would be restarted for ever, and whatever
supervises the launcher would never see a failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deploy.launch as launch  # its new names looked up at call time: old code fails
from deploy.cli import build_parser
from deploy.launch import Child, free_port, stop_all
from tests.integration.cluster_harness import (
    ENGINE_ARGS,
    ROOT,
    alive,
    build_tiny_checkpoint,
    child_env,
    children_of,
)


def _parse(*argv: str):
    return build_parser().parse_args(["launch", "--model", "/m", *argv])


def test_flags_build_the_policy() -> None:
    assert launch.restart_policy(_parse()) is None
    # A run shorter than the engine's startup timeout + 60 s is a failed start.
    assert launch.restart_policy(_parse("--restart")) == launch.RestartPolicy(5, 600.0, 660.0)
    assert launch.restart_policy(_parse("--restart", "--max-restarts", "2", "--restart-window",
                                        "30")) == launch.RestartPolicy(2, 30.0, 660.0)
    assert launch.restart_policy(_parse("--restart", "--engine-startup-timeout", "1800")
                                 ) == launch.RestartPolicy(5, 600.0, 1860.0)


def test_the_startup_wait_covers_the_engines_startup_timeout() -> None:
    """launch's own wait for the cluster is never shorter than the workers' engine startup
    timeout (+60 s), unless --startup-timeout says otherwise."""
    assert launch.startup_timeout(_parse()) == 660.0
    assert launch.startup_timeout(_parse("--engine-startup-timeout", "1800")) == 1860.0
    assert launch.startup_timeout(_parse("--engine-startup-timeout", "30")) == 300.0
    assert launch.startup_timeout(_parse("--startup-timeout", "100")) == 100.0


@pytest.mark.parametrize("argv", [["--max-restarts", "0"], ["--max-restarts", "-1"],
                                  ["--max-restarts", "two"], ["--restart-window", "0"],
                                  ["--restart-window", "nan"], ["--restart-window", "inf"]])
def test_bad_values_are_clear_flag_errors(argv: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--restart", *argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and "unrecognized" not in err, err


@pytest.mark.parametrize("flag", [["--max-restarts", "3"], ["--restart-window", "60"]])
def test_a_limit_without_restart_is_refused(flag: list[str]) -> None:
    with pytest.raises(SystemExit, match="need --restart"):
        launch.restart_policy(_parse(*flag))


def test_restarts_age_out_of_the_window() -> None:
    policy = launch.RestartPolicy(max_restarts=2, window_s=10.0)
    assert policy.recent([0.0, 5.0, 9.0], now=12.0) == [5.0, 9.0]
    assert policy.recent([0.0, 1.0], now=11.0) == []
    with pytest.raises(ValueError):
        launch.RestartPolicy(max_restarts=0)
    with pytest.raises(ValueError):
        launch.RestartPolicy(window_s=0.0)


def _child(tmp_path: Path, name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], child_env(), tmp_path / f"{name}.log")


def _supervise(tmp_path: Path, worker_lives_s: float, policy: launch.RestartPolicy,
               stop_after_s: float, stop_at_restarts: int | None = None
               ) -> tuple[int, Child, float]:
    """Real processes: a proxy that lives on and a worker that dies (exit 3) after
    ``worker_lives_s``, supervised under ``policy`` until done, ``stop_after_s``, or (when
    given) once the worker was restarted ``stop_at_restarts`` times; (exit code, the proxy,
    seconds supervised). Everything is stopped after."""
    proxy = _child(tmp_path, "proxy", "import time; time.sleep(60)")
    worker = _child(tmp_path, "worker0",
                    f"import time; time.sleep({worker_lives_s}); raise SystemExit(3)")
    for child in (proxy, worker):
        child.start()
    started = time.monotonic()
    try:
        code = launch.supervise(
            proxy, [worker], policy, poll_s=0.05,
            stopping=lambda: (time.monotonic() - started > stop_after_s
                              or (stop_at_restarts is not None
                                  and worker.restarts >= stop_at_restarts)))
    finally:
        stop_all([proxy, worker], 5.0)
    return code, proxy, time.monotonic() - started


def test_a_crash_looping_child_is_restarted_up_to_the_limit_then_the_launcher_gives_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real processes: a worker that dies 0.2 s after each start is restarted twice (with
    backoff), then its third death ends supervision with exit code 1."""
    code, proxy, took = _supervise(tmp_path, 0.2, launch.RestartPolicy(2, window_s=60.0), 30)
    out = capsys.readouterr().out
    assert code == 1, out
    assert len(re.findall(r"worker0 \(pid \d+\) died with 3", out)) == 3, out
    assert re.findall(r"restarting worker0 in (\S+) s", out) == ["0.5", "1.0"], out
    assert "restart 2 of 2 allowed within 60 s" in out, out
    assert "giving up on worker0" in out and "--max-restarts 2" in out, out
    assert took < 20
    assert proxy.proc.poll() is not None  # stop_all stopped the healthy one too


def test_deaths_further_apart_than_the_window_are_always_restarted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A window, not a lifetime count: with at most 1 restart per 0.3 s, a child living
    0.6 s (longer than a failed start, 0.5 s here) is restarted every time it dies: its
    second restart is one a lifetime count of 1 would refuse."""
    code, _, _ = _supervise(tmp_path, 0.6,
                            launch.RestartPolicy(1, window_s=0.3, short_run_s=0.5), 30,
                            stop_at_restarts=2)
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(re.findall(r"restarting worker0", out)) >= 2, out
    assert "giving up" not in out


def test_failed_starts_in_a_row_give_up_however_far_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A child that dies before it could have started (here within 5 s of each start: think
    of an engine hanging until its startup timeout) is given up on after max_restarts
    restarts, even when its deaths are further apart than the window."""
    code, _, _ = _supervise(tmp_path, 0.6,
                            launch.RestartPolicy(2, window_s=0.3, short_run_s=5.0), 20)
    out = capsys.readouterr().out
    assert code == 1, out
    assert len(re.findall(r"worker0 \(pid \d+\) died with 3", out)) == 3, out
    assert "giving up on worker0: 3 runs in a row ended within 5 s" in out, out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pdserve_launch_gives_up_and_exits_1(tmp_path: Path) -> None:
    """The real ``pdserve launch --restart --max-restarts 1``: a worker SIGKILLed once is
    restarted; SIGKILLed again, the launcher stops every process and exits 1. (The tiny
    checkpoint: what is served does not matter here, only the processes.)"""
    log = tmp_path / "launch.log"
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "launch", "--prefill", "0", "--decode", "0",
             "--colocated", "1", "--port", str(free_port()), "--log-dir", str(tmp_path / "logs"),
             "--restart", "--max-restarts", "1", "--restart-window", "600",
             "--heartbeat-interval", "1", "--stop-timeout", "10", "--model", str(checkpoint),
             *ENGINE_ARGS],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        for death in (1, 2):
            pid = _wait_started(launcher, log, "colocated0", death)
            pids += [pid, *children_of(pid)]
            if death == 1:
                _wait_text(launcher, log, "ready:")
            os.kill(pid, signal.SIGKILL)
            if death == 1:
                _wait_text(launcher, log, "restarting colocated0")
        launcher.wait(timeout=60)
        text = log.read_text()
        assert launcher.returncode == 1, text[-4000:]
        assert "giving up on colocated0" in text and "stopped" in text, text[-4000:]
        pids += [int(p) for p in re.findall(r"started proxy \(pid (\d+)\)", text)]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], text[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


def _wait_text(launcher: subprocess.Popen, log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert launcher.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _wait_started(launcher: subprocess.Popen, log: Path, name: str, count: int) -> int:
    """The pid of ``name``'s ``count``-th start, once that run listens (its log appends)."""
    child_log = log.parent / "logs" / f"{name}.log"
    deadline = time.monotonic() + 120
    while True:
        text = log.read_text()
        pids = re.findall(rf"started {name} \(pid (\d+)\)", text)
        assert launcher.poll() is None, text[-4000:]
        assert time.monotonic() < deadline, text[-4000:]
        listening = child_log.read_text().count("HTTP server listening on") if pids else 0
        if len(pids) >= count and listening >= count:
            return int(pids[count - 1])
        time.sleep(0.3)


def test_a_dead_proxy_is_restarted_without_restart_and_never_stops_the_workers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --restart the proxy is still restarted (workers re-register with it); a
    proxy that crash loops is given up on alone: the worker keeps running and supervision
    goes on until stopped (exit 0)."""
    proxy = _child(tmp_path, "proxy", "import time; time.sleep(0.2); raise SystemExit(9)")
    worker = _child(tmp_path, "worker0", "import time; time.sleep(60)")
    for child in (proxy, worker):
        child.start()
    started = time.monotonic()
    try:
        code = launch.supervise(proxy, [worker], None, poll_s=0.05,
                                stopping=lambda: (proxy.restarts >= 3
                                                  or time.monotonic() - started > 30.0))
        worker_alive = worker.proc.poll() is None
    finally:
        stop_all([proxy, worker], 5.0)
    out = capsys.readouterr().out
    assert code == 0, out
    assert worker_alive, out
    assert re.findall(r"restarting proxy in (\S+) s", out)[:2] == ["0.5", "1.0"], out
    assert "worker0 (pid" not in out, out
