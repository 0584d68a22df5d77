"""Routing: which worker(s) serve a request.

``RoutingPolicy`` picks one worker among candidates of a role; ``plan_route`` applies the
cluster rule on top of a policy:

0. workers with capabilities (``pdserve worker``, kv_both) are registered for the model ->
   the placement policy decides over every worker of the model (``proxy/placer.py``;
   static P, D and colocated workers join it with their role's capabilities);
1. a prefill worker and a decode worker exist for the model -> disaggregated (P, D).
   With ``prefill_overflow`` N, a P with N prefill legs in flight takes no more; when every
   P has N, D gets the original request and prefills it itself (conditional
   disaggregation: P's overload spills to D instead of queueing). D's own load is not
   consulted: on two H100s, overflow into a D whose KV cache is full still serves more
   than the P queue does (docs/PERFORMANCE.md, conditional disaggregation);
2. else a colocated worker exists -> the whole request goes to it;
3. else a decode worker exists (no prefill worker left, or the prefill leg failed on every
   one) -> decode-only: D gets the original request and prefills it itself;
4. else -> ``NoWorkerError`` (HTTP 503).

A request that names no model is for the one model registered; with several it is a 400
(P and D would otherwise be picked among different models' workers).

Pure: no sockets, no clock of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine_core.cluster.messages import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL
from engine_core.errors import InvalidRequestError, ModelNotFoundError, NoWorkerError
from proxy.registry import InstanceRegistry, WorkerState

if TYPE_CHECKING:
    from proxy.placement import Placement

MODE_PD = "pd"
MODE_COLOCATED = "colocated"
MODE_DECODE_ONLY = "decode_only"
MODE_PREFILL_OVERFLOW = "prefill_overflow"
MODE_LOCAL = "local"  # placed whole on a worker (proxy/placement.py)


class RoutingPolicy(Protocol):
    """Chooses one worker of a role among non-empty candidates.

    ``key`` is the request's prefix key (``proxy.forwarding.affinity_key``): requests that
    begin alike share it; only the prefix-affinity policy reads it.
    """

    name: str

    def choose(self, role: str, candidates: Sequence[WorkerState],
               key: str | None = None) -> WorkerState:
        """Return one of ``candidates`` (never empty)."""
        ...


class RoundRobinPolicy:
    """Cycles through the candidates of each role, in registration order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, role: str, candidates: Sequence[WorkerState],
               key: str | None = None) -> WorkerState:
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

    def choose(self, role: str, candidates: Sequence[WorkerState],
               key: str | None = None) -> WorkerState:
        best = min(self.score(w) for w in candidates)
        tied = [w for w in candidates if self.score(w) == best]
        index = self._rotation.get(role, 0)
        self._rotation[role] = index + 1
        return tied[index % len(tied)]


class PrefixAffinityPolicy:
    """Requests that begin alike go to the same worker of each role, so its prefix cache
    (P's computed prompts, D's landed ones, fewer blocks to transfer) serves them again.

    The worker is the rendezvous-hash winner of the request's prefix key among the
    candidates: a worker joining or leaving moves only the keys it wins or won. Affinity
    yields to load: when the winner's least-load score exceeds the lowest by more than
    ``max_imbalance`` (in-flight legs and queued requests, mostly), the least-loaded worker
    takes the request instead, so one hot prefix cannot pile up on one worker. Requests
    without a key are routed by least load.
    """

    name = "prefix_affinity"

    def __init__(self, max_imbalance: float = 8.0) -> None:
        self.max_imbalance = max_imbalance
        self._load = LeastLoadPolicy()

    @staticmethod
    def _rank(key: str, worker: WorkerState) -> bytes:
        # surrogatepass: a prompt may hold a lone surrogate (valid JSON; the worker decides).
        return hashlib.blake2b(f"{key}\x00{worker.worker_id}".encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()

    def choose(self, role: str, candidates: Sequence[WorkerState],
               key: str | None = None) -> WorkerState:
        if key is None:
            return self._load.choose(role, candidates)
        winner = max(candidates, key=lambda w: self._rank(key, w))
        lightest = min(self._load.score(w) for w in candidates)
        if self._load.score(winner) - lightest > self.max_imbalance:
            return self._load.choose(role, candidates)
        return winner


POLICIES = {RoundRobinPolicy.name: RoundRobinPolicy, LeastLoadPolicy.name: LeastLoadPolicy,
            PrefixAffinityPolicy.name: PrefixAffinityPolicy}


def make_policy(name: str, affinity_max_imbalance: float = 8.0) -> RoutingPolicy:
    """Build a policy by its CLI name."""
    if name == PrefixAffinityPolicy.name:
        return PrefixAffinityPolicy(affinity_max_imbalance)
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
    placement: Placement | None = None  # the placement policy's decision, when it decided
    prefill_tokens: int = 0  # the prompt tokens the prefilling worker computes (estimate)

    def describe(self) -> str:
        """Short text for logs."""
        if self.prefill is not None:
            return f"{self.mode} P={self.prefill.worker_id} D={self.decode.worker_id}"
        return f"{self.mode} {self.decode.worker_id}"


def _only_model(registry: InstanceRegistry) -> str | None:
    """The model a request naming none is for: the one served, else it is ambiguous.

    Without this, P and D would be picked among every model's workers independently, and
    P's KV of one model could be sent to a D of another."""
    models = registry.models()
    if len(models) > 1:
        raise InvalidRequestError("model is required: this proxy serves several models "
                                  f"({', '.join(models)})", "model")
    return models[0] if models else None


Placer = Callable[[InstanceRegistry, "str | None", "frozenset[str] | set[str]"], "Route | None"]


def plan_route(registry: InstanceRegistry, policy: RoutingPolicy, model: str | None,
               exclude: frozenset[str] | set[str] = frozenset(), key: str | None = None,
               prefill_overflow: int = 0, placer: Placer | None = None) -> Route:
    """Apply the cluster rule (module docstring) for one attempt; ``exclude`` lists failed
    workers, ``key`` is the request's prefix key for the policy, ``prefill_overflow`` the
    prefill legs in flight on every P from which D prefills alone (0: never), ``placer``
    the placement of rule 0 (None from it: no worker with capabilities)."""
    if model is not None and registry.workers(model=model) == [] and len(registry) > 0:
        raise ModelNotFoundError(f"The model `{model}` does not exist. "
                                 f"Served models: {', '.join(registry.models())}")
    if model is None:
        model = _only_model(registry)
    if placer is not None:
        placed = placer(registry, model, exclude)
        if placed is not None:
            return placed
    prefills = registry.candidates(ROLE_PREFILL, model, exclude)
    decodes = registry.candidates(ROLE_DECODE, model, exclude)
    if prefills and decodes:
        if prefill_overflow > 0:
            # A P at the cap takes no more; when none has room, D prefills alone.
            room = [p for p in prefills if p.in_flight < prefill_overflow]
            if not room:
                return Route(MODE_PREFILL_OVERFLOW,
                             decode=policy.choose(ROLE_DECODE, decodes, key))
            prefills = room
        return Route(MODE_PD, decode=policy.choose(ROLE_DECODE, decodes, key),
                     prefill=policy.choose(ROLE_PREFILL, prefills, key))
    colocated = registry.candidates(ROLE_COLOCATED, model, exclude)
    if colocated:
        return Route(MODE_COLOCATED, decode=policy.choose(ROLE_COLOCATED, colocated, key))
    if decodes:
        return Route(MODE_DECODE_ONLY, decode=policy.choose(ROLE_DECODE, decodes, key))
    if not len(registry):
        raise NoWorkerError("No worker is registered with the proxy; start prefill and decode "
                            "workers (or a colocated one) that register to it.")
    raise NoWorkerError("No decode or colocated worker is available for this request"
                        + (f" (model {model!r})" if model else "") + ".")
