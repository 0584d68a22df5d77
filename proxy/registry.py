"""InstanceRegistry: the workers the proxy knows, their heartbeats, load and in-flight counts.

Pure: no sockets, no tasks. The registration server feeds it heartbeats, a periodic task
calls ``expire``, and the request path reads candidates and counts legs in and out. Time
comes from an injected clock so expiry is testable without sleeping.

A worker's name (its HTTP address) and its KV address are bound to the sender that
registered them first (the authenticated sender id of its messages): only that sender can
refresh, change or deregister them while it keeps heartbeating. A sender silent for more
than two of its heartbeat intervals (a process that died) can be replaced by a new one, so a
restarted worker registers again at once. At most ``max_workers`` are registered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_core.cluster.messages import (
    CAP_DECODE,
    CAP_WHOLE,
    CAPABILITIES,
    ROLE_CAPABILITIES,
    Heartbeat,
    WorkerLoad,
)
from engine_core.cluster.trust import CAPACITY, WRONG_IDENTITY, TrustRefusal
from engine_core.parallel.kv_layout import PeerRanks

Clock = Callable[[], float]

DEFAULT_MAX_WORKERS = 256
# Heartbeat intervals a bound sender may miss before another may take its name over.
TAKEOVER_MISSED_HEARTBEATS = 2.0


@dataclass
class WorkerState:
    """One registered worker: what it announced plus what the proxy observed."""

    role: str
    http_address: str
    model: str
    zmq_address: str | None
    version: str
    load: WorkerLoad
    registered_at: float
    last_heartbeat: float
    sender_id: str = ""  # the authenticated sender the worker's name is bound to
    heartbeat_interval_s: float | None = None
    in_flight: int = 0
    num_requests: int = 0
    num_errors: int = 0
    # After a connection failure the worker is avoided until this time (or its next
    # heartbeat), so requests stop bouncing off a dead worker before it expires.
    suspect_until: float | None = None
    announced: frozenset[str] = frozenset()  # capabilities from its heartbeat (or role)
    restricted: frozenset[str] | None = None  # the admin call's subset (None: all announced)
    # Prompt tokens the proxy placed here whose prefill has not answered yet: fresher than
    # the heartbeat's queue, which is seconds old.
    pending_prefill_tokens: int = 0
    # Legs by the part the worker plays in them (prefill / decode / whole): its role mix.
    parts_in_flight: dict[str, int] = field(default_factory=dict)
    parts_total: dict[str, int] = field(default_factory=dict)
    # Its KV layout and every rank's connector address (None: one rank at zmq_address).
    kv_ranks: PeerRanks | None = None

    @property
    def capabilities(self) -> frozenset[str]:
        """What the proxy may place here now: announced, less what the admin call removed."""
        return self.announced if self.restricted is None else self.announced & self.restricted

    @property
    def worker_id(self) -> str:
        """The worker's identity in the registry: its HTTP address."""
        return self.http_address

    @property
    def url(self) -> str:
        """Base URL of the worker's OpenAI server (an IPv6 host in brackets: a worker started
        with ``--host ::1`` says ``::1:PORT``, which as ``http://::1:PORT`` no URL parser
        takes, so every request to it failed)."""
        host, _, port = self.http_address.rpartition(":")
        if ":" in host and not host.startswith("["):
            return f"http://[{host}]:{port}"
        return f"http://{self.http_address}"

    def to_json(self, now: float) -> dict[str, Any]:
        """A JSON-ready view for ``/instances``."""
        return {
            "role": self.role,
            "http_address": self.http_address,
            "zmq_address": self.zmq_address,
            "kv_ranks": None if self.kv_ranks is None else self.kv_ranks.to_wire(),
            "model": self.model,
            "version": self.version,
            "load": {
                "num_running": self.load.num_running,
                "num_decoding": self.load.num_decoding,
                "num_waiting": self.load.num_waiting,
                "kv_cache_usage": self.load.kv_cache_usage,
                "num_waiting_for_remote_kv": self.load.num_waiting_for_remote_kv,
                "sleeping": self.load.sleeping,
                "num_prefill_tokens_queued": self.load.num_prefill_tokens_queued,
                "prefill_tokens_per_s": self.load.prefill_tokens_per_s,
                "prefill_alone_tokens_per_s": self.load.prefill_alone_tokens_per_s,
                "decode_step_s": self.load.decode_step_s,
                "decode_step_target_s": self.load.decode_step_target_s,
                "decode_base_s": self.load.decode_base_s,
                "decode_hidden_s": self.load.decode_hidden_s,
                "decode_per_row_s": self.load.decode_per_row_s,
            },
            "capabilities": sorted(self.capabilities),
            "role_mix": {"in_flight": dict(self.parts_in_flight), "total": dict(self.parts_total)},
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "in_flight": self.in_flight,
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "seconds_since_heartbeat": round(now - self.last_heartbeat, 3),
            "registered_seconds_ago": round(now - self.registered_at, 3),
            "suspect": self.suspect_until is not None and now < self.suspect_until,
        }


@dataclass
class RegistryEvents:
    """What one ``expire`` or ``heartbeat`` call changed (for logs and metrics)."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


class InstanceRegistry:
    """Workers keyed by HTTP address, dropped when they miss heartbeats for ``heartbeat_timeout_s``."""

    def __init__(self, heartbeat_timeout_s: float = 10.0, suspect_s: float = 5.0,
                 clock: Clock = time.monotonic, max_workers: int = DEFAULT_MAX_WORKERS) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self._timeout_s = heartbeat_timeout_s
        self._max_workers = max_workers
        self._suspect_s = suspect_s
        self._clock = clock
        self._workers: dict[str, WorkerState] = {}
        self._on_removed: list[Callable[[str], None]] = []
        self._on_expired: list[Callable[[str], None]] = []

    def add_removal_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(worker_id)`` whenever a worker leaves (deregistered or expired):
        the proxy's metrics drop its per-worker series then."""
        self._on_removed.append(listener)

    def add_expiry_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(worker_id)`` when a worker's heartbeats stopped (not when it
        deregistered: a draining worker still finishes the requests it took)."""
        self._on_expired.append(listener)

    def _removed(self, worker_id: str) -> None:
        for listener in self._on_removed:
            listener(worker_id)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._timeout_s

    def heartbeat(self, message: Heartbeat, sender_id: str = "") -> bool:
        """Add or refresh a worker; return True when it is new (or changed role/model).

        ``sender_id`` is the authenticated sender of the message (in-process registrations
        share the empty one). Raises TrustRefusal: ``wrong_identity`` when the name or the KV
        address is bound to another live sender, ``capacity`` when ``max_workers`` are
        registered and this one is new."""
        now = self._clock()
        existing = self._workers.get(message.http_address)
        if existing is not None and existing.sender_id != sender_id \
                and not self._silent(existing, now):
            raise TrustRefusal(WRONG_IDENTITY, f"{message.http_address} is registered by "
                               "another live sender")
        if message.zmq_address is not None and (existing is None
                                                or existing.zmq_address != message.zmq_address):
            self._claim_kv_address(message, sender_id, now)
        if existing is None and len(self._workers) >= self._max_workers:
            raise TrustRefusal(CAPACITY, f"{self._max_workers} workers are registered")
        announced = frozenset(message.capabilities or ROLE_CAPABILITIES[message.role])
        if existing is not None and existing.sender_id == sender_id \
                and existing.role == message.role \
                and existing.model == message.model and existing.zmq_address == message.zmq_address \
                and existing.kv_ranks == message.kv_ranks:
            existing.load = message.load
            existing.version = message.version
            existing.announced = announced
            existing.last_heartbeat = now
            existing.suspect_until = None  # it is alive again
            return False
        # Legs already sent to this address still end against it: the new state keeps their
        # count (a fresh zero would run low as they end, under --prefill-overflow's cap and
        # least load's view).
        self._workers[message.http_address] = WorkerState(
            role=message.role, http_address=message.http_address, model=message.model,
            zmq_address=message.zmq_address, version=message.version, load=message.load,
            registered_at=now, last_heartbeat=now, announced=announced, sender_id=sender_id,
            heartbeat_interval_s=message.heartbeat_interval_s, kv_ranks=message.kv_ranks)
        if existing is not None:
            new = self._workers[message.http_address]
            new.in_flight, new.restricted = existing.in_flight, existing.restricted
            new.pending_prefill_tokens = existing.pending_prefill_tokens
            new.parts_in_flight = existing.parts_in_flight
        return True

    def _silent(self, worker: WorkerState, now: float) -> bool:
        """Whether ``worker`` missed enough heartbeats that another sender may take its name
        or KV address over (its process is gone, or restarted)."""
        interval = worker.heartbeat_interval_s or self._timeout_s / TAKEOVER_MISSED_HEARTBEATS
        return now - worker.last_heartbeat > TAKEOVER_MISSED_HEARTBEATS * interval

    def _claim_kv_address(self, message: Heartbeat, sender_id: str, now: float) -> None:
        """Refuse a KV address another live sender holds; drop a silent holder of it."""
        for holder in list(self._workers.values()):
            if holder.zmq_address != message.zmq_address \
                    or holder.http_address == message.http_address \
                    or holder.sender_id == sender_id:
                continue
            if not self._silent(holder, now):
                raise TrustRefusal(WRONG_IDENTITY, f"kv address {message.zmq_address} is "
                                   f"registered by {holder.http_address}")
            self.remove(holder.http_address, holder.sender_id)

    def remove(self, http_address: str, sender_id: str = "") -> bool:
        """Drop a worker now (clean deregistration); return whether it was known. Raises
        TrustRefusal(``wrong_identity``) when another sender registered it."""
        worker = self._workers.get(http_address)
        if worker is None:
            return False
        if worker.sender_id != sender_id:
            raise TrustRefusal(WRONG_IDENTITY, f"{http_address} is registered by another sender")
        del self._workers[http_address]
        self._removed(http_address)
        return True

    def expire(self) -> list[str]:
        """Drop workers whose last heartbeat is older than the timeout; return their ids."""
        deadline = self._clock() - self._timeout_s
        gone = [wid for wid, w in self._workers.items() if w.last_heartbeat < deadline]
        for wid in gone:
            del self._workers[wid]
            self._removed(wid)
            for listener in self._on_expired:
                listener(wid)
        return gone

    def get(self, http_address: str) -> WorkerState | None:
        """The worker registered at this address, if any."""
        return self._workers.get(http_address)

    def workers(self, role: str | None = None, model: str | None = None) -> list[WorkerState]:
        """Registered workers, optionally of one role and serving one model, in join order."""
        return [w for w in self._workers.values()
                if (role is None or w.role == role) and (model is None or w.model == model)]

    def candidates(self, role: str | None, model: str | None = None,
                   exclude: frozenset[str] | set[str] = frozenset()) -> list[WorkerState]:
        """Routable workers of a role (None: any): awake, not excluded, and not suspect
        unless all are."""
        pool = [w for w in self.workers(role, model)
                if w.worker_id not in exclude and not w.load.sleeping]
        now = self._clock()
        healthy = [w for w in pool if w.suspect_until is None or now >= w.suspect_until]
        return healthy or pool

    def models(self) -> list[str]:
        """The union of served model names, sorted."""
        return sorted({w.model for w in self._workers.values()})

    def servable_models(self) -> list[str]:
        """Models a request can be answered for now, sorted: those with a worker that can
        decode (a model with only prefill workers gets a 503)."""
        return sorted({w.model for w in self._workers.values()
                       if w.capabilities & {CAP_DECODE, CAP_WHOLE}})

    def restrict(self, http_address: str, capabilities: frozenset[str] | None) -> bool:
        """Limit what the proxy places on a worker to ``capabilities`` (None: all it
        announces), from the next request on; legs in flight go on. False: unknown worker."""
        worker = self._workers.get(http_address)
        if worker is None:
            return False
        if capabilities is not None and not capabilities <= set(CAPABILITIES):
            raise ValueError(f"capabilities must be among {CAPABILITIES}")
        worker.restricted = capabilities
        return True

    def part_started(self, http_address: str, part: str, prefill_tokens: int = 0) -> None:
        """A leg in which the worker plays ``part``, computing ``prefill_tokens`` of prompt."""
        worker = self._workers.get(http_address)
        if worker is not None:
            worker.parts_in_flight[part] = worker.parts_in_flight.get(part, 0) + 1
            worker.parts_total[part] = worker.parts_total.get(part, 0) + 1
            worker.pending_prefill_tokens += prefill_tokens

    def prefill_answered(self, http_address: str, prefill_tokens: int) -> None:
        """The prompt tokens of a ``part_started`` leg are computed (or never will be)."""
        worker = self._workers.get(http_address)
        if worker is not None:
            worker.pending_prefill_tokens = max(0, worker.pending_prefill_tokens - prefill_tokens)

    def part_finished(self, http_address: str, part: str) -> None:
        worker = self._workers.get(http_address)
        if worker is not None and worker.parts_in_flight.get(part, 0) > 0:
            worker.parts_in_flight[part] -= 1

    def leg_started(self, http_address: str) -> None:
        """Count a request leg sent to a worker."""
        worker = self._workers.get(http_address)
        if worker is not None:
            worker.in_flight += 1
            worker.num_requests += 1

    def leg_finished(self, http_address: str, ok: bool, connection_failed: bool = False) -> None:
        """Count a leg's end; a connection failure also marks the worker suspect for a while."""
        worker = self._workers.get(http_address)
        if worker is None:
            return
        worker.in_flight = max(0, worker.in_flight - 1)
        if not ok:
            worker.num_errors += 1
        if connection_failed:
            worker.suspect_until = self._clock() + self._suspect_s

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-ready list of every worker's state."""
        now = self._clock()
        return [w.to_json(now) for w in self._workers.values()]

    def __len__(self) -> int:
        return len(self._workers)
