"""Registration and heartbeat messages workers send to the proxy (ZMQ + msgpack).

A worker sends ``Heartbeat`` every few seconds; the first one registers it. ``Deregister``
is sent on a clean shutdown so the proxy stops routing to it at once instead of waiting for
the heartbeat expiry. Both travel through ``REGISTRATION_CODEC`` (type tag, version, field
types) and are then checked by ``validate`` for the values the codec cannot know.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_core.addresses import is_host_port
from engine_core.codec import MessageCodec
from engine_core.errors import MessageDecodeError
from engine_core.parallel.kv_layout import KVLayoutError, PeerRanks

ROLE_PREFILL = "P"
ROLE_DECODE = "D"
ROLE_COLOCATED = "colocated"
ROLE_WORKER = "worker"  # kv_both: its capabilities say what it does, the proxy places work
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED, ROLE_WORKER)
# A role's ``role`` label value in the proxy's metrics (every family uses these).
ROLE_LABELS = {ROLE_PREFILL: "prefill", ROLE_DECODE: "decode", ROLE_COLOCATED: "colocated",
               ROLE_WORKER: "worker"}

# What a worker can do: prefill for another worker's decode, decode a request prefilled
# elsewhere, serve a request whole. A static role is a fixed set of them.
CAP_PREFILL = "prefill"
CAP_DECODE = "decode"
CAP_WHOLE = "whole"
CAPABILITIES = (CAP_PREFILL, CAP_DECODE, CAP_WHOLE)
ROLE_CAPABILITIES = {ROLE_PREFILL: (CAP_PREFILL,), ROLE_DECODE: (CAP_DECODE,),
                     ROLE_COLOCATED: (CAP_WHOLE,), ROLE_WORKER: CAPABILITIES}


@dataclass
class WorkerLoad:
    """Load stats a worker reports with each heartbeat (engine scheduler view)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_waiting_for_remote_kv: int = 0
    sleeping: bool = False  # sleep mode: asleep workers get no requests until awake
    # Placement inputs (engine_core/step_rates.py): prompt tokens still to compute, the
    # measured marginal prefill rate of mixed steps (tokens/s) and the decode part of a step
    # of its current decodes (s, predicted from steps of decodes alone); 0: not measured
    # yet. The decode-step target (s) that bounds its steps with decodes (0: none): while it
    # decodes it prefills at ``step_rates.prefill_rate_beside_decodes``.
    num_prefill_tokens_queued: int = 0
    num_decoding: int = 0  # running requests past their prefill
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_step_target_s: float = 0.0
    decode_base_s: float = 0.0  # the decode step's fixed part: a step of one or two decodes
    decode_hidden_s: float = 0.0  # the part of the decode step a prompt chunk beside it hides
    # The rate of steps of prompt tokens alone (0: not measured): a prefill lane's rate.
    prefill_alone_tokens_per_s: float = 0.0
    # What each decode row adds (0: not measured): the proxy extends ``decode_step_s`` to the
    # batch it knows of there (``step_rates.extrapolated_step``).
    decode_per_row_s: float = 0.0


@dataclass
class Heartbeat:
    """A worker's periodic announcement; the first one registers it.

    ``http_address`` ("host:port") identifies the worker; ``zmq_address`` ("host:kv_port") is
    where its KV connector listens and is what the peer leg's ``remote_kv_address`` names;
    ``kv_ranks`` its KV layout and every rank's connector address (rank 0's is
    ``zmq_address``), which the proxy hands its peers.
    """

    role: str
    http_address: str
    model: str
    zmq_address: str | None = None
    version: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    heartbeat_interval_s: float | None = None
    # A ``worker``'s capabilities (CAPABILITIES); empty: those of its role.
    capabilities: list[str] = field(default_factory=list)
    kv_ranks: PeerRanks | None = None


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
    if message.kv_ranks is not None:
        try:
            ranks = PeerRanks.from_wire(message.kv_ranks.to_wire())
        except KVLayoutError as exc:
            raise MessageDecodeError(f"kv_ranks: {exc}") from None
        if ranks.address != message.zmq_address:
            raise MessageDecodeError(f"kv_ranks name rank 0 at {ranks.address:.80}, not the "
                                     "zmq_address")
    if not set(message.capabilities) <= set(CAPABILITIES) or len(message.capabilities) > 3:
        raise MessageDecodeError(f"capabilities must be among {CAPABILITIES}")
    load = message.load
    if min(load.num_running, load.num_waiting, load.num_waiting_for_remote_kv,
           load.num_prefill_tokens_queued, load.num_decoding) < 0:
        raise MessageDecodeError("load counts must be >= 0")
    if not all(0.0 <= value < math.inf for value in (
            load.prefill_tokens_per_s, load.decode_step_s, load.decode_step_target_s,
            load.decode_base_s, load.decode_hidden_s, load.prefill_alone_tokens_per_s,
            load.decode_per_row_s)):
        raise MessageDecodeError("prefill_tokens_per_s, decode_step_s, decode_step_target_s, "
                                 "decode_base_s, decode_hidden_s, prefill_alone_tokens_per_s "
                                 "and decode_per_row_s must be finite, >= 0")
    if not 0.0 <= load.kv_cache_usage <= 1.0:
        raise MessageDecodeError("kv_cache_usage must be within [0, 1]")
    return message


def decode_registration(payload: bytes) -> Heartbeat | Deregister:
    """Decode and validate one registration-socket payload."""
    message = REGISTRATION_CODEC.decode(payload)
    if not isinstance(message, (Heartbeat, Deregister)):
        raise MessageDecodeError(f"unexpected top-level message {type(message).__name__}")
    return validate(message)
