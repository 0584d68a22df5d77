"""Supervision of launched children: start, watch, restart with backoff, stop.

``Child`` is one process (proxy or worker) with its log; ``supervise`` watches them and
restarts a dead one under ``RestartPolicy`` (or reports it); ``stop_all`` ends them:
terminate, then kill after a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger("pdserve.launch")


def die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# --restart backs off: a child that dies again soon after a restart waits twice as long
# each time, up to RESTART_MAX_DELAY_S (a crash loop restarted every 0.5 s floods its log
# and the GPU's startup work); one that ran RESTART_RESET_S counts as healthy again.
RESTART_FIRST_DELAY_S = 0.5
RESTART_MAX_DELAY_S = 30.0
RESTART_RESET_S = 60.0


def restart_delay(restarts: int, ran_s: float) -> tuple[float, int]:
    """(seconds to wait before starting a child that died after running ``ran_s``,
    its restart count after this one) given the restarts it had so far."""
    if ran_s >= RESTART_RESET_S:
        restarts = 0
    return min(RESTART_FIRST_DELAY_S * 2 ** restarts, RESTART_MAX_DELAY_S), restarts + 1


# The cluster's startup wait is at least this, and covers the workers' own engine startup
# timeout (a longer --engine-startup-timeout would otherwise be cut short by launch).
MIN_STARTUP_TIMEOUT_S = 300.0
STARTUP_MARGIN_S = 60.0


def engine_startup_timeout(args: argparse.Namespace) -> float:
    """The workers' engine startup timeout (flag, else VLLM_ENGINE_READY_TIMEOUT_S folded in
    by the CLI, else the engine's default)."""
    from engine_core.engine_client import DEFAULT_STARTUP_TIMEOUT_S

    return getattr(args, "engine_startup_timeout", None) or DEFAULT_STARTUP_TIMEOUT_S


def startup_timeout(args: argparse.Namespace) -> float:
    """How long launch waits for the cluster: ``--startup-timeout``, else long enough for
    the workers' engines to load."""
    if args.startup_timeout is not None:
        return args.startup_timeout
    return max(MIN_STARTUP_TIMEOUT_S, engine_startup_timeout(args) + STARTUP_MARGIN_S)


@dataclass(frozen=True)
class RestartPolicy:
    """The bound on ``--restart``: at most ``max_restarts`` restarts of one child within
    any ``window_s`` seconds.

    Why a bound: backoff alone restarted a worker that can never come up (a model that no
    longer fits, a bad checkpoint) every 30 s for ever, and the launcher kept running, so
    the supervisor above it (systemd, Kubernetes) and the operator never saw a failure. A
    window, not a lifetime count: a worker that dies once a day is restarted every time.
    5 in 10 minutes covers a crash loop of models that take minutes to load."""

    max_restarts: int = 5
    window_s: float = 600.0
    # A run shorter than this counts as a failed start. More than max_restarts failed starts
    # in a row also give up, however far apart: a child that hangs loading until its engine
    # startup timeout (600 s) and dies never has six deaths inside one window.
    short_run_s: float = 660.0

    def __post_init__(self) -> None:
        if (self.max_restarts < 1 or not 0 < self.window_s < float("inf")
                or not 0 < self.short_run_s < float("inf")):
            raise ValueError(f"restart policy needs max_restarts >= 1, window_s > 0 and "
                             f"short_run_s > 0, got {self.max_restarts}, {self.window_s}, "
                             f"{self.short_run_s}")

    def recent(self, restart_times: list[float], now: float) -> list[float]:
        """The restarts of ``restart_times`` that still count at ``now``."""
        return [t for t in restart_times if now - t < self.window_s]

    def describe(self) -> str:
        return f"--max-restarts {self.max_restarts} within --restart-window {self.window_s:g} s"


def restart_policy(args: argparse.Namespace) -> RestartPolicy | None:
    """The ``--restart`` policy from the flags; None without ``--restart``."""
    if not args.restart:
        if args.max_restarts is not None or args.restart_window is not None:
            raise SystemExit("pdserve launch: --max-restarts and --restart-window need "
                             "--restart (without it no child is restarted)")
        return None
    default = RestartPolicy()
    window_s = args.restart_window or default.window_s
    return RestartPolicy(max_restarts=args.max_restarts or default.max_restarts,
                         window_s=window_s,
                         short_run_s=max(window_s,
                                         engine_startup_timeout(args) + STARTUP_MARGIN_S))


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_address: str | None = None
    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    restarts: int = 0  # in the current backoff run (restart_delay)
    started_at: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again (--restart)
    restart_times: list[float] = field(default_factory=list)  # when it died and was restarted
    failed_starts: int = 0  # deaths in a row after a run shorter than RestartPolicy.short_run_s

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the child runs
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        logger.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the child's process group (it leads its own session):
        a worker that died can leave its engine process behind, still loading or holding
        its GPU memory, and a restarted worker would then find the GPU taken."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def stop_all(children: list[Child], timeout_s: float) -> None:
    live = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in live:
        child.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for child in live:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs; killing it", child.name, timeout_s)
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
    for child in children:
        child.kill_group()  # what a dead or stopped child left behind (its engine)
        if child.log is not None:
            child.log.close()


# How often the launcher looks at its children and at its stop flag: a SIGTERM (the flag)
# is acted on within this, and a poll costs microseconds.
POLL_S = 0.1
GIVE_UP_STOPS = "stopping everything, exit 1"
GIVE_UP_PROXY = "the workers keep serving (any other proxy they register with)"


def _on_death(child: Child, policy: RestartPolicy, now: float,
              giving_up: str = GIVE_UP_STOPS) -> bool:
    """Schedule a restart of ``child``, which just died; False when ``policy`` says it is
    crash looping (the caller gives up, which ``giving_up`` tells the operator)."""
    recent = policy.recent(child.restart_times, now)
    short = now - child.started_at < policy.short_run_s
    child.failed_starts = child.failed_starts + 1 if short else 0
    if len(recent) >= policy.max_restarts:
        print(f"pdserve launch: giving up on {child.name}: it died again after "
              f"{len(recent)} restart(s) within {policy.window_s:g} s ({policy.describe()}); "
              f"{giving_up}; see {child.log_path}", flush=True)
        return False
    if child.failed_starts > policy.max_restarts:
        print(f"pdserve launch: giving up on {child.name}: {child.failed_starts} runs in a row "
              f"ended within {policy.short_run_s:g} s of their start; {giving_up}; "
              f"see {child.log_path}", flush=True)
        return False
    child.restart_times = [*recent, now]
    delay, child.restarts = restart_delay(child.restarts, now - child.started_at)
    child.restart_at = now + delay
    if child.log is not None:
        child.log.close()
    print(f"pdserve launch: restarting {child.name} in {delay:.1f} s (restart "
          f"{len(child.restart_times)} of {policy.max_restarts} allowed within "
          f"{policy.window_s:g} s)", flush=True)
    return True


def supervise(proxy: Child, workers: list[Child], policy: RestartPolicy | None,
              stopping: Callable[[], bool], poll_s: float = POLL_S) -> int:
    """Watch the running children until ``stopping()``: report each death, restart the
    child under ``policy`` (None: only the proxy, under the default bound). A proxy that
    outruns its bound is reported and left down; the workers keep serving. Returns the
    launcher's exit code: 0 when stopped, 1 when a worker outran ``policy``."""
    proxy_policy = policy or RestartPolicy()
    reported: set[str] = set()
    while not stopping():
        now = time.monotonic()
        for child in [proxy, *workers]:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                continue
            code = child.proc.poll()
            if code is None or child.name in reported:
                continue
            print(f"pdserve launch: {child.name} (pid {child.proc.pid}) died with {code}; "
                  f"log {child.log_path}", flush=True)
            child.kill_group()
            if child is proxy:
                if not _on_death(child, proxy_policy, now, GIVE_UP_PROXY):
                    reported.add(child.name)
            elif policy is not None:
                if not _on_death(child, policy, now):
                    return 1
            else:
                reported.add(child.name)
        time.sleep(poll_s)
    return 0
