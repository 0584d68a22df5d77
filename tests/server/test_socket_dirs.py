"""The engine's ipc socket directories do not pile up under /tmp when API processes are
SIGKILLed: the next server to start removes those whose sockets nobody listens on any more.

Each test runs its servers under a private TMPDIR (short, as unix socket paths must be).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.launch import free_port
from engine_core import ipc_sockets
from tests.integration.cluster_harness import alive, child_env
from tests.server.conftest import kill_with_engines
from tests.server.test_shutdown import _SCRIPT, _engine_pids

PREFIX = "pdserve-engine-"


def _age(path: Path, seconds: float = 120.0) -> None:
    """Make ``path`` look untouched for ``seconds`` (younger ones are never swept)."""
    then = time.time() - seconds
    os.utime(path, (then, then))
_LOGGING_SCRIPT = "import logging\nlogging.basicConfig(level=logging.INFO)\n" + _SCRIPT


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pdsd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _dead_socket(path: Path) -> None:
    """A socket file whose process is gone: bound, then closed (connect is refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def _stale_dir(parent: Path, name: str, age_s: float = 120.0) -> Path:
    path = parent / name
    path.mkdir(mode=0o700)
    _dead_socket(path / "input")
    _dead_socket(path / "output")
    _age(path, age_s)
    return path


def test_only_directories_whose_sockets_refuse_connections_are_removed(
        tmpdir_short: Path) -> None:
    from engine_core.ipc_sockets import remove_stale_socket_dirs

    host = ipc_sockets.host_prefix()
    stale = _stale_dir(tmpdir_short, f"{host}1234-abcd")
    live = _stale_dir(tmpdir_short, f"{host}99-live")
    (live / "output").unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "output"))
    listener.listen()
    _age(live)
    fresh = tmpdir_short / f"{host}77-fresh"  # just made by mkdtemp, not bound yet
    fresh.mkdir()
    _age(fresh)
    # Bound but not listening yet (a server starting): refuses, but is too young to judge.
    starting = _stale_dir(tmpdir_short, f"{host}88-starting", age_s=0.0)
    foreign = _stale_dir(tmpdir_short, f"{host}55-other")
    (foreign / "notes.txt").write_text("not ours to delete")
    # Another host's (a temp dir shared between hosts: its live sockets refuse this host).
    elsewhere = _stale_dir(tmpdir_short, f"{PREFIX}otherhost-1-abcd")
    other = _stale_dir(tmpdir_short, "someone-else")
    link = tmpdir_short / f"{host}66-link"
    link.symlink_to(other)
    try:
        assert remove_stale_socket_dirs(str(tmpdir_short)) == 1
    finally:
        listener.close()
    assert not stale.exists()
    for kept in (live, fresh, starting, foreign, elsewhere, other):
        assert kept.is_dir(), kept
    assert link.is_symlink()
    _age(live)
    assert remove_stale_socket_dirs(str(tmpdir_short)) == 1  # live's socket now refuses
    _age(starting)
    assert remove_stale_socket_dirs(str(tmpdir_short)) == 1  # and an old refusing one goes


def _start_server(tmpdir: Path) -> subprocess.Popen:
    """A real API server (tests/server/test_shutdown.py's script: its engine stays inside
    a long startup) with ``tmpdir`` as its temp dir."""
    return subprocess.Popen([sys.executable, "-c", _LOGGING_SCRIPT, str(free_port())],
                            env={**child_env(), "TMPDIR": str(tmpdir)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _socket_dirs(tmpdir: Path) -> set[Path]:
    return {p for p in tmpdir.iterdir() if p.name.startswith(PREFIX)}


def _wait_for_engine(proc: subprocess.Popen, tmpdir: Path, before: set[Path]
                     ) -> tuple[list[int], Path]:
    """The server's engine process(es) and its new socket directory, once both exist."""
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no engine process appeared"
        engines = _engine_pids(proc.pid)
        new = _socket_dirs(tmpdir) - before
        if engines and new:
            assert len(new) == 1, new
            return engines, new.pop()
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], engines: list[int]) -> None:
    for proc in procs:
        kill_with_engines(proc, [])
    kill_with_engines(procs[0], engines)


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def test_the_next_server_removes_what_a_killed_server_left(tmpdir_short: Path) -> None:
    """SIGKILL runs no cleanup: the killed server's socket directory stays behind (its
    engine is SIGKILLed with it, so it cannot remove it either). The next server to start
    removes it; a clean stop removes that server's own."""
    first = _start_server(tmpdir_short)
    second = None
    engines: list[int] = []
    try:
        first_engines, first_dir = _wait_for_engine(first, tmpdir_short, set())
        engines += first_engines
        first.kill()
        first.communicate(timeout=30)
        assert _wait_gone(first_engines), "the engine outlived its API process"
        assert first_dir.is_dir(), "SIGKILL left nothing behind? the test proves nothing"
        assert first_dir.name.startswith(ipc_sockets.host_prefix())
        _age(first_dir)  # younger directories are never swept (a server may be starting)

        second = _start_server(tmpdir_short)
        second_engines, second_dir = _wait_for_engine(second, tmpdir_short, {first_dir})
        engines += second_engines
        assert not first_dir.exists(), "the stale socket directory was left in place"
        assert second_dir.is_dir()
        second.send_signal(signal.SIGTERM)
        output, _ = second.communicate(timeout=30)
        assert second.returncode == 0, output
        assert "removed 1 stale engine socket director" in output, output
        assert _socket_dirs(tmpdir_short) == set()
        assert second_dir.name.startswith(f"{ipc_sockets.host_prefix()}{second.pid}-")  # host, API pid
    finally:
        _stop([p for p in (first, second) if p is not None], engines)


def test_a_live_servers_socket_directory_is_kept(tmpdir_short: Path) -> None:
    """A second server on the host must not take a running server's sockets."""
    first = _start_server(tmpdir_short)
    second = None
    engines: list[int] = []
    try:
        first_engines, first_dir = _wait_for_engine(first, tmpdir_short, set())
        engines += first_engines
        second = _start_server(tmpdir_short)
        second_engines, second_dir = _wait_for_engine(second, tmpdir_short, {first_dir})
        engines += second_engines
        assert first_dir.is_dir() and sorted(p.name for p in first_dir.iterdir()) == [
            "input", "output"]
        for proc in (first, second):
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, output
            assert "stale engine socket" not in output, output
        assert _socket_dirs(tmpdir_short) == set()
    finally:
        _stop([p for p in (first, second) if p is not None], engines)


def test_a_temp_dir_too_long_for_unix_sockets_falls_back_to_tmp(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A deep TMPDIR (a test runner's, a job scheduler's) would make the sockets' paths
    longer than a unix socket address holds: the directory goes to /tmp instead, and
    its sockets fit."""
    import zmq


    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert not ipc_sockets.socket_path_fits(str(deep))
    assert ipc_sockets.socket_parent() == ipc_sockets.SHORT_SOCKET_PARENT
    made = Path(ipc_sockets.make_socket_dir())
    try:
        assert made.parent == Path(ipc_sockets.SHORT_SOCKET_PARENT)
        assert made.name.startswith(f"{ipc_sockets.host_prefix()}{os.getpid()}-")
        for name in ("input", "output"):
            path = str(made / name)
            assert len(path.encode()) <= zmq.IPC_PATH_MAX_LEN
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(path)  # the address fits
    finally:
        shutil.rmtree(made, ignore_errors=True)

    short = tmp_path / "s"
    short.mkdir()
    if ipc_sockets.socket_path_fits(str(short)):  # pytest's own tmp_path is short enough
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        assert ipc_sockets.socket_parent() == str(short)


def test_no_parent_short_enough_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    from engine_core.errors import ConfigError

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(ipc_sockets, "SHORT_SOCKET_PARENT", str(deep))
    with pytest.raises(ConfigError, match="set TMPDIR to a short writable directory"):
        ipc_sockets.socket_parent()


def test_long_host_names_keep_distinct_short_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts sharing a temp dir must never sweep each other's sockets: a long name is cut,
    and the hash of the whole name keeps names that differ only at the end apart."""

    prefixes = []
    for name in ("a-very-long-statefulset-name.cluster.local-decode-0",
                 "a-very-long-statefulset-name.cluster.local-decode-1", "short-host"):
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        prefixes.append(ipc_sockets.host_prefix())
    assert len(set(prefixes)) == 3
    assert prefixes[2] == "pdserve-engine-short-host-"
    assert all(len(p) <= len("pdserve-engine-") + 32 + 1 for p in prefixes)
