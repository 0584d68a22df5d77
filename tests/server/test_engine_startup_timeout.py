"""The engine startup timeout is a flag (``--engine-startup-timeout``, or vLLM's
``VLLM_ENGINE_READY_TIMEOUT_S``) that reaches the engine client; it was fixed at 600 s."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from deploy.cli import build_parser, main
from deploy.launch import free_port
from tests.integration.cluster_harness import alive, child_env
from tests.server.conftest import kill_with_engines
from tests.server.test_shutdown import _engine_pids

ENV = "VLLM_ENGINE_READY_TIMEOUT_S"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The ``ServerOptions`` that ``run_server`` / ``serve_worker`` get (nothing starts)."""
    import engine_core.server.api_server as api_server
    import engine_core.server.worker as worker

    calls: dict[str, Any] = {}

    def fake_run_server(config: Any, options: Any, engine_factory: Any = None,
                        on_startup: Any = (), readiness: Any = None) -> None:
        calls["options"] = options

    def fake_serve_worker(config: Any, options: Any, connector_factory: Any,
                          interval: float = 3.0) -> None:
        calls["options"] = options

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    monkeypatch.setattr(worker, "serve_worker", fake_serve_worker)
    monkeypatch.delenv(ENV, raising=False)
    return calls


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_the_flag_reaches_the_server_options(command: str, served: dict[str, Any]) -> None:
    assert main([command, "/models/x", "--engine-startup-timeout", "1800"]) == 0
    assert served["options"].engine_startup_timeout_s == 1800.0


def test_the_default_is_600_s(served: dict[str, Any]) -> None:
    assert main(["serve", "/models/x"]) == 0
    assert served["options"].engine_startup_timeout_s == 600.0


def test_vllms_environment_variable_is_the_default_and_the_flag_wins(
        served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "3600")
    assert main(["serve", "/models/x"]) == 0
    assert served["options"].engine_startup_timeout_s == 3600.0
    assert main(["serve", "/models/x", "--engine-startup-timeout", "30"]) == 0
    assert served["options"].engine_startup_timeout_s == 30.0


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "ten"])
def test_a_bad_flag_value_is_a_clear_error(value: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/models/x", "--engine-startup-timeout", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --engine-startup-timeout" in err and "unrecognized" not in err, err


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_environment_value_is_a_clear_error(value: str, served: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "/models/x"])
    assert ENV in str(exc.value.code) and repr(value) in str(exc.value.code)
    assert "options" not in served


# `pdserve serve` itself, its engine factory swapped for one whose startup never ends.
_SCRIPT = """
import sys
import engine_core.server.api_server as api_server
from deploy.cli import main
from tests.server.test_shutdown import slow_engine_factory

real_run_server = api_server.run_server
api_server.run_server = lambda config, options, engine_factory=None, on_startup=(), \\
    readiness=None: real_run_server(config, options, slow_engine_factory, on_startup, readiness)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_server_whose_engine_does_not_start_in_time_exits_1_naming_the_flag(how: str) -> None:
    """A hung model load ends at the given timeout (not 600 s later): the server exits 1,
    its error names the flag that raises the limit, and the engine process is gone."""
    argv = ["serve", "/unused/model", "--device", "cpu", "--port", str(free_port())]
    env = child_env()
    env.pop(ENV, None)
    if how == "flag":
        argv += ["--engine-startup-timeout", "1.5"]
    else:
        env[ENV] = "1.5"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engines: list[int] = []
    try:
        while proc.poll() is None and time.monotonic() - started < 60:
            engines += [pid for pid in _engine_pids(proc.pid) if pid not in engines]
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=30)
    finally:
        kill_with_engines(proc, engines)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, output
    assert "engine did not start within 1.5 s" in output, output
    assert "--engine-startup-timeout" in output and ENV in output, output
    assert elapsed < 40, f"took {elapsed:.0f} s"
    assert engines, "no engine process was seen"
    assert not [pid for pid in engines if alive(pid)], "the engine outlived the timeout"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_python_dash_m_worker_honours_the_environment_variable(role: str) -> None:
    """``python -m prefill|decode`` are ``pdserve prefill|decode``: a bad value of vLLM's
    variable is refused before anything starts (it used to be ignored there)."""
    env = dict(child_env(), **{ENV: "soon"})
    done = subprocess.run([sys.executable, "-m", role, "/models/x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert ENV in done.stderr and "'soon'" in done.stderr, done.stderr
