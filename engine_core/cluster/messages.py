"""Registration and heartbeat messages workers send to the proxy (ZMQ + msgpack).

A worker sends ``Heartbeat`` every few seconds; the first one registers it. ``Deregister``
is sent on a clean shutdown so the proxy stops routing to it at once instead of waiting for
the heartbeat expiry. Both travel through ``REGISTRATION_CODEC`` (type tag, version, field
types) and are then checked by ``validate`` for the values the codec cannot know.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.addresses import is_host_port
from engine_core.codec import MessageCodec
from engine_core.errors import MessageDecodeError

ROLE_PREFILL = "P"
ROLE_DECODE = "D"
ROLE_COLOCATED = "colocated"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED)
# A role's ``role`` label value in the proxy's metrics (every family uses these).
ROLE_LABELS = {ROLE_PREFILL: "prefill", ROLE_DECODE: "decode", ROLE_COLOCATED: "colocated"}


@dataclass
class WorkerLoad:
    """Load stats a worker reports with each heartbeat (engine scheduler view)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_waiting_for_remote_kv: int = 0
    sleeping: bool = False  # sleep mode: asleep workers get no requests until awake


@dataclass
class Heartbeat:
    """A worker's periodic announcement; the first one registers it.

    ``http_address`` ("host:port") identifies the worker; ``zmq_address`` ("host:kv_port") is
    where its KV connector listens and is what the peer leg's ``remote_kv_address`` names.
    """

    role: str
    http_address: str
    model: str
    zmq_address: str | None = None
    version: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    heartbeat_interval_s: float | None = None


@dataclass
class Deregister:
    """A worker leaving cleanly: drop it now."""

    http_address: str


REGISTRATION_CODEC = MessageCodec([Heartbeat, Deregister, WorkerLoad], max_bytes=1 << 20)


# The model and version become metric labels and /instances fields: bounded, like vLLM's
# served model names in practice (a HF repo id is at most 96 characters).
MAX_MODEL_CHARS = 256
MAX_VERSION_CHARS = 64


def _check_address(value: str, what: str) -> None:
    if not is_host_port(value):
        raise MessageDecodeError(f"{what} must be host:port, got {value[:80]!r}")


def validate(message: Heartbeat | Deregister) -> Heartbeat | Deregister:
    """Check what the codec's type check cannot; raise MessageDecodeError when invalid."""
    _check_address(message.http_address, "http_address")
    if isinstance(message, Deregister):
        return message
    if message.role not in ROLES:
        raise MessageDecodeError(f"role must be one of {ROLES}, got {message.role!r:.20}")
    if not 0 < len(message.model) <= MAX_MODEL_CHARS:
        raise MessageDecodeError(f"model must be 1-{MAX_MODEL_CHARS} characters")
    if len(message.version) > MAX_VERSION_CHARS:
        raise MessageDecodeError(f"version must be at most {MAX_VERSION_CHARS} characters")
    if message.role != ROLE_COLOCATED:
        if message.zmq_address is None:
            raise MessageDecodeError(f"a {message.role} worker needs a zmq_address")
        _check_address(message.zmq_address, "zmq_address")
    load = message.load
    if min(load.num_running, load.num_waiting, load.num_waiting_for_remote_kv) < 0:
        raise MessageDecodeError("load counts must be >= 0")
    if not 0.0 <= load.kv_cache_usage <= 1.0:
        raise MessageDecodeError("kv_cache_usage must be within [0, 1]")
    return message


def decode_registration(payload: bytes) -> Heartbeat | Deregister:
    """Decode and validate one registration-socket payload."""
    message = REGISTRATION_CODEC.decode(payload)
    if not isinstance(message, (Heartbeat, Deregister)):
        raise MessageDecodeError(f"unexpected top-level message {type(message).__name__}")
    return validate(message)
