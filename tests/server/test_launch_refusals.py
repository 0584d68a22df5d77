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
