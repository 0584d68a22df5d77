"""Routing: which worker(s) serve a request.

``RoutingPolicy`` picks one worker among candidates of a role; ``plan_route`` applies the
cluster rule on top of a policy:

1. a prefill worker and a decode worker exist for the model -> disaggregated (P, D);
2. else a colocated worker exists -> the whole request goes to it;
3. else a decode worker exists (no prefill worker left, or the prefill leg failed on every
   one) -> decode-only: D gets the original request and prefills it itself;
4. else -> ``NoWorkerError`` (HTTP 503).

Pure: no sockets, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_core.errors import ModelNotFoundError, NoWorkerError
from proxy.messages import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL
from proxy.registry import InstanceRegistry, WorkerState

MODE_PD = "pd"
MODE_COLOCATED = "colocated"
MODE_DECODE_ONLY = "decode_only"


class RoutingPolicy(Protocol):
    """Chooses one worker of a role among non-empty candidates."""

    name: str

    def choose(self, role: str, candidates: Sequence[WorkerState]) -> WorkerState:
        """Return one of ``candidates`` (never empty)."""
        ...


class RoundRobinPolicy:
    """Cycles through the candidates of each role, in registration order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, role: str, candidates: Sequence[WorkerState]) -> WorkerState:
        index = self._next.get(role, 0)
        self._next[role] = index + 1
        return candidates[index % len(candidates)]


class LeastLoadPolicy:
    """Picks the candidate with the lowest load score; ties rotate so equal workers share.

    score = proxy's own in-flight legs + queued requests from the last heartbeat
            + ``kv_weight`` * KV cache usage (0..1).
    The in-flight count is fresh (the proxy updates it per leg); the heartbeat stats add
    what the proxy cannot see (other proxies, direct clients) and memory pressure, which
    matters most for decode workers that hold long contexts.
    """

    name = "least_load"

    def __init__(self, kv_weight: float = 4.0) -> None:
        self._kv_weight = kv_weight
        self._rotation: dict[str, int] = {}

    def score(self, worker: WorkerState) -> float:
        """The load score of one worker (lower is better)."""
        return (worker.in_flight + worker.load.num_waiting
                + self._kv_weight * worker.load.kv_cache_usage)

    def choose(self, role: str, candidates: Sequence[WorkerState]) -> WorkerState:
        best = min(self.score(w) for w in candidates)
        tied = [w for w in candidates if self.score(w) == best]
        index = self._rotation.get(role, 0)
        self._rotation[role] = index + 1
        return tied[index % len(tied)]


POLICIES = {RoundRobinPolicy.name: RoundRobinPolicy, LeastLoadPolicy.name: LeastLoadPolicy}


def make_policy(name: str) -> RoutingPolicy:
    """Build a policy by its CLI name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}") from None


@dataclass(frozen=True)
class Route:
    """Where one attempt of a request goes."""

    mode: str
    decode: WorkerState  # D, or the colocated worker
    prefill: WorkerState | None = None

    def describe(self) -> str:
        """Short text for logs."""
        if self.prefill is not None:
            return f"{self.mode} P={self.prefill.worker_id} D={self.decode.worker_id}"
        return f"{self.mode} {self.decode.worker_id}"


def plan_route(registry: InstanceRegistry, policy: RoutingPolicy, model: str | None,
               exclude: frozenset[str] | set[str] = frozenset()) -> Route:
    """Apply the cluster rule (module docstring) for one attempt; ``exclude`` lists failed workers."""
    if model is not None and registry.workers(model=model) == [] and len(registry) > 0:
        raise ModelNotFoundError(f"The model `{model}` does not exist. "
                                 f"Served models: {', '.join(registry.models())}")
    prefills = registry.candidates(ROLE_PREFILL, model, exclude)
    decodes = registry.candidates(ROLE_DECODE, model, exclude)
    if prefills and decodes:
        return Route(MODE_PD, decode=policy.choose(ROLE_DECODE, decodes),
                     prefill=policy.choose(ROLE_PREFILL, prefills))
    colocated = registry.candidates(ROLE_COLOCATED, model, exclude)
    if colocated:
        return Route(MODE_COLOCATED, decode=policy.choose(ROLE_COLOCATED, colocated))
    if decodes:
        return Route(MODE_DECODE_ONLY, decode=policy.choose(ROLE_DECODE, decodes))
    if not len(registry):
        raise NoWorkerError("No worker is registered with the proxy; start prefill and decode "
                            "workers (or a colocated one) that register to it.")
    raise NoWorkerError("No decode or colocated worker is available for this request"
                        + (f" (model {model!r})" if model else "") + ".")
