"""`pdserve launch` and `pdserve proxy` refuse what cannot serve before anything starts: an
empty or decode-less cluster, negative counts, bad ports, a non-positive stop timeout, and
a proxy port already taken (one clear line and exit 2, not a traceback after the workers
had started)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from deploy.cli import build_parser, main
from tests.integration.cluster_harness import child_env


@pytest.mark.parametrize("flags", [["--prefill", "-1"], ["--decode", "-2"], ["--port", "99999"],
                                   ["--port", "0"], ["--stop-timeout", "-5"],
                                   ["--registration-port", "x"]])
def test_bad_launch_flags_are_refused_by_the_parser(flags: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["launch", *flags])
    assert exc.value.code == 2
    assert "argument" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--prefill", "1", "--decode", "0"], "without a decode worker"),
    (["--prefill", "0", "--decode", "0"], "nothing would serve"),
])
def test_a_cluster_that_cannot_serve_is_refused_before_anything_starts(
        flags: list[str], message: str, capsys) -> None:
    assert main(["launch", *flags]) == 2
    assert message in capsys.readouterr().err


def _taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_launch_refuses_a_taken_proxy_port(capsys) -> None:
    with _taken_port() as sock:
        port = sock.getsockname()[1]
        assert main(["launch", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert str(port) in err and "Traceback" not in err


def test_the_proxy_refuses_a_taken_port_in_one_line() -> None:
    with _taken_port() as sock:
        port = sock.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "proxy", "--port", str(port)],
                              env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and str(port) in done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_launch_refuses_one_port_for_http_and_registration(tmp_path, capsys) -> None:
    """Refused in one line before the log folder, the model or any child."""
    port = _free_port()
    log_dir = tmp_path / "logs"
    assert main(["launch", "--port", str(port), "--registration-port", str(port),
                 "--log-dir", str(log_dir)]) == 2
    err = capsys.readouterr().err
    assert f"--port and --registration-port are both {port}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not log_dir.exists()


@pytest.mark.parametrize("flags", [["--registration-port", "{port}"], ["--proxy-port", "{port}"]])
def test_the_proxy_refuses_one_port_for_http_and_registration_in_one_line(
        flags: list[str]) -> None:
    port = str(_free_port())
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "proxy", "--port", port,
                           *(f.format(port=port) for f in flags)],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--port and --registration-port are both {port}" in lines[0], \
        done.stderr
