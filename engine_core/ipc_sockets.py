"""The private directories of the unix sockets between an API process and its engine.

Each server makes one under the temp dir (or ``SHORT_SOCKET_PARENT`` when the temp dir's
path is too long for a socket address) and sweeps the ones killed servers left behind,
telling a dead server's directory from a live one by asking its sockets.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import tempfile
import time

import zmq

from engine_core.errors import ConfigError

logger = logging.getLogger("engine_core.engine_client")

# The ipc socket directories an engine client's start() creates under the temp dir (or SHORT_SOCKET_PARENT):
# this prefix, the host's name (a temp dir may be shared between hosts, where another
# host's live sockets refuse this one), the API process's pid (for an operator reading
# /tmp) and a random part; inside, only these sockets.
SOCKET_DIR_PREFIX = "pdserve-engine-"
_SOCKET_NAMES = frozenset({"input", "output"})
# A longer host name is cut to its first _HOST_HEAD_CHARS plus a hash of the whole name,
# so the socket paths stay short and hosts that differ at the end keep distinct prefixes.
_MAX_HOST_CHARS = 32
_HOST_HEAD_CHARS = 23
_PROBE_TIMEOUT_S = 1.0
# The socket directory's parent when the temp dir's path is too long for unix sockets.
SHORT_SOCKET_PARENT = "/tmp"
# A directory changed this recently is never swept: a starting server's socket refuses
# between its bind and its listen, which must not read as a dead server's.
_SWEEP_MIN_AGE_S = 60.0


def host_prefix() -> str:
    """This host's socket directories' name prefix."""
    name = socket.gethostname()
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in name)
    if len(host) > _MAX_HOST_CHARS:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        host = f"{host[:_HOST_HEAD_CHARS]}.{digest}"
    return f"{SOCKET_DIR_PREFIX}{host}-"


def _socket_accepts(path: str) -> bool:
    """Whether some process still listens on the unix socket file ``path``.

    Only a refused connection counts as dead: that is what a socket file left by a killed
    process answers. Anything else (accepted, a full backlog, a path too long) counts as
    alive, so a live server's directory is never taken."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:
            return True
    return True


def _stale_sockets(path: str, now: float) -> list[str] | None:
    """The socket files of a socket directory of ours whose every socket refuses
    connections (its API process was killed, SIGKILL or OOM, before it could remove it);
    None for one to leave alone: another user's, one holding anything else, one with no
    socket yet, or one changed in the last ``_SWEEP_MIN_AGE_S`` (a server starting)."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return None
    if now - info.st_mtime < _SWEEP_MIN_AGE_S:
        return None
    names = os.listdir(path)
    if not names or not set(names) <= _SOCKET_NAMES:
        return None
    entries = [os.path.join(path, name) for name in names]
    for entry in entries:
        if not stat.S_ISSOCK(os.lstat(entry).st_mode) or _socket_accepts(entry):
            return None
    return entries


def remove_stale_socket_dirs(parent: str | None = None) -> int:
    """Remove the socket directories that killed API processes left in ``parent`` (default:
    the temp dir); return how many.

    Why here: a SIGKILLed API process runs no cleanup, and its engine cannot do it for it
    (the kernel SIGKILLs the engine with its parent, see ``engine_process.die_with_parent``).
    Each server that starts sweeps what earlier ones left, so they do not pile up. Liveness
    is asked of the sockets themselves, not of a pid: a pid can be reused, or belong to
    another pid namespace sharing this /tmp."""
    parent = parent or tempfile.gettempdir()
    prefix, now, removed = host_prefix(), time.time(), 0
    with os.scandir(parent) as entries:
        candidates = [e.path for e in entries if e.name.startswith(prefix)]
    for path in candidates:
        try:
            stale = _stale_sockets(path, now)
            if stale is None:
                continue
            for entry in stale:  # only what was checked
                os.unlink(entry)
            os.rmdir(path)
        except OSError:  # gone already (another server swept it), or not ours to remove
            continue
        removed += 1
    return removed


def socket_path_fits(parent: str) -> bool:
    """Whether the sockets of a directory made in ``parent`` fit a unix socket address
    (``zmq.IPC_PATH_MAX_LEN`` bytes): mkdtemp adds 8 random characters to the prefix."""
    directory = os.path.join(parent, f"{host_prefix()}{os.getpid()}-{'x' * 8}")
    longest = max(len(os.path.join(directory, name).encode()) for name in _SOCKET_NAMES)
    return longest <= zmq.IPC_PATH_MAX_LEN


def socket_parent() -> str:
    """Where the engine's socket directory goes: the temp dir, or /tmp when the temp dir's
    path is too long for a unix socket's address (a deep TMPDIR, as a test runner or a
    job scheduler sets); a clear error when neither fits."""
    for parent in _socket_parents():
        if socket_path_fits(parent) and os.path.isdir(parent) and os.access(parent, os.W_OK):
            return parent
    raise ConfigError(f"no directory for the engine's unix sockets: the temp dir "
                      f"{tempfile.gettempdir()!r} and {SHORT_SOCKET_PARENT} are each too long "
                      f"a path ({zmq.IPC_PATH_MAX_LEN} bytes at most for a socket) or not "
                      f"writable: set TMPDIR to a short writable directory")


def _socket_parents() -> list[str]:
    """Where socket directories may be: the temp dir, then SHORT_SOCKET_PARENT."""
    return list(dict.fromkeys((tempfile.gettempdir(), SHORT_SOCKET_PARENT)))


def make_socket_dir() -> str:
    """A fresh private directory for the engine's ipc sockets, after sweeping stale ones
    (from both places a server may have put them)."""
    parent = socket_parent()
    for candidate in _socket_parents():
        if not os.path.isdir(candidate):
            continue
        removed = remove_stale_socket_dirs(candidate)
        if removed:
            logger.info("removed %d stale engine socket directories (left by killed "
                        "servers) from %s", removed, candidate)
    return tempfile.mkdtemp(prefix=f"{host_prefix()}{os.getpid()}-", dir=parent)
