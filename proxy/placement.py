"""Placement: where one request runs, from a snapshot of the workers. Pure.

A worker is a set of capabilities: ``prefill`` (prefills for another worker's decode),
``decode`` (decodes a request prefilled elsewhere), ``whole`` (serves a request from prompt
to last token). ``place`` chooses between serving the request whole on the worker that
decodes it (``local``) and prefilling it on another worker P while D decodes it
(``disaggregated``).

The TPOT target is held in the engines: a worker with a decode-step target (``pdserve
launch`` gives every placed worker ``decode_step_target_s``, the TPOT target less its
headroom) bounds each step that carries decodes to that target, taking prompt tokens only
in the time its decodes leave. A worker that decodes therefore prefills at a capped rate
(``engine_core.step_rates.prefill_rate_beside_decodes``), and one without decodes at its
full rate (its measured rate of steps without decodes, far above a mixed step's chunks'). The policy only has to put each prefill where it finishes first at those rates:

1. D is the decode-capable worker that takes the stream: not over the TPOT target (its
   decode step, predicted for its batch, within ``decode_step_limit`` of it), then a significant cached prefix
   of this prompt, then the largest decode batch: decodes **pack** onto the workers already
   decoding, which leaves the others free of decodes to prefill at full rate (the cluster
   splits itself into prefill and decode workers as far as the load needs; a worker starts
   decoding when the ones decoding are at that limit). Then the least KV in use (a worker
   at ``kv_full`` takes new decodes only when every one is). Over the target everywhere,
   the least slow takes it.
2. Serving whole on D is always a candidate, so the cluster never does worse than replicas.
   It is taken when the prompt's uncached part on D is short (``short_prompt_tokens``), or
   no other worker can prefill it.
3. The prefill goes where it finishes first: queued prefill tokens plus this prompt's
   uncached part, over the worker's rate (capped while it decodes); a move pays the
   transfer's fixed cost. P is the prefill-capable worker other than D that harms the
   fewest decodes, then finishes first. A prefill *harms* a worker's decodes only where no
   decode-step target protects them (a worker started without one). It moves off D when:
   - ``tpot``: it harms D's decodes, fewer of P's, and P meets the TTFT target (or beats D);
   - ``ttft``: D would miss the TTFT target and P finishes sooner;
   - ``sooner``: P finishes sooner than D by more than the transfer's fixed cost;
   - ``lane``: D finishes sooner, but a lane plan holds, D is outside its prefill lane, P is
     in it (or cannot decode) and finishes within ``lane_ttft_share`` of the TTFT target (the
     decode lane prefills only what the lane cannot take in time).
   Otherwise it stays (``local_first``).

Ties go to the worker listed first: the caller rotates the list to share work evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE
from engine_core.step_rates import prefill_rate_beside_decodes

PLACEMENT_LOCAL = "local"
PLACEMENT_DISAGGREGATED = "disaggregated"

# Reasons (the ``reason`` label of pdserve:proxy_placements_total).
REASON_SHORT = "short"            # uncached part at most short_prompt_tokens: stays on D
REASON_CACHED = "cached"          # long, but D's cached prefix leaves a short part
REASON_LOCAL = "local_first"      # D finishes the prefill first (or equally soon)
REASON_NO_PREFILL = "no_prefill_worker"  # no other worker can prefill for D
REASON_NO_WHOLE = "decode_only"   # D cannot serve whole requests: it must get the KV
REASON_TPOT = "tpot"              # D has no decode-step target: its decodes would stall
REASON_TTFT = "ttft"              # D would miss the TTFT target, P is sooner
REASON_SOONER = "sooner"          # P finishes the prefill sooner than D
REASON_LANE = "lane"              # a lane plan holds: P is in the prefill lane, within TTFT
REASONS = (REASON_SHORT, REASON_CACHED, REASON_LOCAL, REASON_NO_PREFILL, REASON_NO_WHOLE,
           REASON_TPOT, REASON_TTFT, REASON_SOONER, REASON_LANE)


@dataclass(frozen=True)
class PlacementConfig:
    """The operator's targets and the policy's constants (``pdserve proxy`` flags)."""

    slo_ttft_s: float = 1.0           # --slo-ttft-ms
    slo_tpot_s: float = 0.02          # --slo-tpot-ms
    # A prompt whose uncached part is at most this many tokens stays where it decodes: its
    # prefill is about one decode step's work, less than a transfer's fixed cost.
    short_prompt_tokens: int = 256
    # Rate assumed for a worker that has not measured one yet (tokens/s).
    default_prefill_tokens_per_s: float = 4096.0
    # The fixed cost of moving a prefill (two legs, the KV transfer's control round trip);
    # P must beat D by more than this.
    transfer_overhead_s: float = 0.005
    kv_full: float = 0.95             # KV usage at which a worker takes no new decodes
    # The share of the TPOT target that steps with decodes are planned to (the workers'
    # decode-step target): the rest absorbs a step that runs longer than predicted.
    tpot_headroom: float = 0.9
    # The share of the TPOT target a worker's decode step alone may reach while it takes
    # new streams: past it they start on another worker. Above the headroom, as such a
    # worker's steps carry only a block of prompt; below 1 for batches that grow between
    # heartbeats.
    decode_step_limit: float = 0.9
    # While a lane plan holds, a prompt goes to the prefill lane if the lane is predicted to
    # finish it within this share of the TTFT target. A prompt the decode lane computes
    # costs every one of its streams' TPOT, one late in the lane's queue only its own TTFT.
    lane_ttft_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s", "default_prefill_tokens_per_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number > 0")
        if self.short_prompt_tokens < 0:
            raise ValueError("short_prompt_tokens must be >= 0")
        if not 0 <= self.transfer_overhead_s < math.inf or not 0 < self.kv_full <= 1:
            raise ValueError("transfer_overhead_s must be >= 0 and kv_full in (0, 1]")
        if not 0 < self.lane_ttft_share <= 1:
            raise ValueError("lane_ttft_share must be in (0, 1]")
        if not (0 < self.tpot_headroom <= 1 and 0 < self.decode_step_limit <= 1):
            raise ValueError("tpot_headroom and decode_step_limit must be in (0, 1]")

    @property
    def decode_step_target_s(self) -> float:
        """The step time the cluster plans to: the TPOT target less its headroom. Placed
        workers bound their steps with decodes to it (``--decode-step-target-ms``)."""
        return self.tpot_headroom * self.slo_tpot_s


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the proxy knows of one worker when a request arrives."""

    worker_id: str
    capabilities: frozenset[str]
    queued_prefill_tokens: int = 0     # prompt tokens waiting to be computed there
    prefill_tokens_per_s: float = 0.0  # measured rate beside decodes; 0: not measured yet
    prefill_alone_tokens_per_s: float = 0.0  # measured rate without decodes; 0: not yet
    decode_batch: int = 0              # requests decoding there
    kv_usage: float = 0.0              # 0..1
    step_s: float = 0.0                # its decode step without prefill; 0: unknown
    cached_tokens: int = 0             # this prompt's prefix already in its cache (estimate)
    decode_step_target_s: float = 0.0  # the engine's bound on steps with decodes; 0: none
    decode_base_s: float = 0.0         # its decode step's fixed part; 0: not measured
    decode_hidden_s: float = 0.0       # the part of its decode step a prompt chunk hides
    num_decoding: int = 0              # the decodes its heartbeat counted
    decode_per_row_s: float = 0.0      # what each decode row adds to its fixed part; 0: unknown

    def can(self, capability: str) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True)
class Placement:
    """The decision: ``decode`` serves the request (whole when ``prefill`` is None)."""

    placement: str                     # PLACEMENT_LOCAL | PLACEMENT_DISAGGREGATED
    decode: str
    prefill: str | None
    reason: str
    predicted_prefill_s: float         # when the prompt's KV is ready, from now


class NoPlacementError(Exception):
    """No worker can decode the request."""


def rate_beside_decodes(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    """The marginal prompt tokens/s of ``worker``'s mixed steps (each of its two rates
    stands in for the other until measured; the default until either is)."""
    return (worker.prefill_tokens_per_s or worker.prefill_alone_tokens_per_s
            or config.default_prefill_tokens_per_s)


def alone_rate(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    """Prompt tokens/s ``worker`` computes with no decodes."""
    return (worker.prefill_alone_tokens_per_s or worker.prefill_tokens_per_s
            or config.default_prefill_tokens_per_s)


# A worker whose decodes fill its step target still prefills a block a step: its rate is
# taken as at least this share of its full rate (a finite prediction, far behind the rest).
MIN_RATE_SHARE = 0.02


def effective_rate(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    """Prompt tokens/s ``worker`` computes now: its full rate without decodes, the share
    its decode-step target leaves while it decodes."""
    if worker.decode_batch == 0:
        return alone_rate(worker, config)
    rate = rate_beside_decodes(worker, config)
    return max(MIN_RATE_SHARE * rate, prefill_rate_beside_decodes(
        rate, worker.step_s, worker.decode_step_target_s, worker.decode_hidden_s))


def uncached_tokens(worker: WorkerSnapshot, prompt_tokens: int) -> int:
    """The prompt tokens ``worker`` would compute (at least the last one, which samples)."""
    return max(1, prompt_tokens - worker.cached_tokens)


def prefill_finish_s(worker: WorkerSnapshot, prompt_tokens: int,
                     config: PlacementConfig) -> float:
    """Predicted seconds until ``worker`` has this prompt's KV: its queue, then the prompt,
    at its effective rate."""
    work = worker.queued_prefill_tokens + uncached_tokens(worker, prompt_tokens)
    return work / effective_rate(worker, config)


def harm(worker: WorkerSnapshot) -> int:
    """Decode streams a prefill on ``worker`` stalls: those of a worker without a
    decode-step target (its steps take whole prefill chunks); none where the target holds."""
    return 0 if worker.decode_step_target_s else worker.decode_batch


def over_target(worker: WorkerSnapshot, config: PlacementConfig) -> bool:
    """Its decode step alone is past ``decode_step_limit`` of the TPOT target: no more
    streams go there while another worker has room."""
    return worker.step_s > config.decode_step_limit * config.slo_tpot_s


def decodes(worker: WorkerSnapshot) -> bool:
    """Whether ``worker`` can take a stream (decode one prefilled elsewhere, or serve whole)."""
    return worker.can(CAP_DECODE) or worker.can(CAP_WHOLE)


def in_prefill_lane(worker: WorkerSnapshot, prefill_lane: frozenset[str]) -> bool:
    """Whether ``worker`` prefills for the lane plan: one of its lane, or one that cannot
    decode (it takes no streams either way)."""
    return worker.worker_id in prefill_lane or not decodes(worker)


def choose_decode(workers: Sequence[WorkerSnapshot], prompt_tokens: int,
                  config: PlacementConfig,
                  prefill_lane: frozenset[str] | None = None) -> WorkerSnapshot:
    """Rule 1: the decode-capable worker that takes the stream (outside ``prefill_lane``
    while another can take it; spread over the others when a lane plan holds). A worker
    that cannot serve whole takes it only when another can prefill for it, or none other
    can decode it."""
    decoders = [w for w in workers if decodes(w)]
    if not decoders:
        raise NoPlacementError("no worker can decode this request")
    prefillers = sum(w.can(CAP_PREFILL) for w in workers)
    decoders = [w for w in decoders
                if w.can(CAP_WHOLE) or prefillers > w.can(CAP_PREFILL)] or decoders
    if prefill_lane:
        decoders = [w for w in decoders if w.worker_id not in prefill_lane] or decoders
    roomy = [w for w in decoders if w.kv_usage < config.kv_full] or decoders
    spread = prefill_lane is not None

    def key(item: tuple[int, WorkerSnapshot]) -> tuple[bool, int, float, float, int]:
        index, worker = item
        cached = worker.cached_tokens if worker.cached_tokens > config.short_prompt_tokens else 0
        if spread:  # the lane plan sized the decode lane: balance it
            return (False, -min(cached, prompt_tokens), worker.decode_batch,
                    worker.kv_usage, index)
        over = over_target(worker, config)
        # Over the target everywhere: the least slow takes it (packing would pile on).
        shape = worker.step_s if over else -worker.decode_batch
        return (over, -min(cached, prompt_tokens), shape, worker.kv_usage, index)

    return min(enumerate(roomy), key=key)[1]


def choose_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot,
                   prompt_tokens: int, config: PlacementConfig,
                   prefill_lane: frozenset[str] | None = None) -> WorkerSnapshot | None:
    """The prefill-capable worker other than ``decode`` whose prefill stalls the fewest
    decodes, then finishes first; None when there is none. While a lane plan holds, P is a
    worker of ``prefill_lane`` or one that cannot decode (it takes no streams either way);
    any other only for a D that cannot serve whole (its KV must come from elsewhere)."""
    others = [w for w in workers if w.can(CAP_PREFILL) and w.worker_id != decode.worker_id]
    if prefill_lane is not None:
        lane = [w for w in others if in_prefill_lane(w, prefill_lane)]
        others = lane if lane or decode.can(CAP_WHOLE) else others
    if not others:
        return None

    def key(item: tuple[int, WorkerSnapshot]) -> tuple[int, float, int, int]:
        index, worker = item
        return (harm(worker), prefill_finish_s(worker, prompt_tokens, config),
                worker.decode_batch, index)

    return min(enumerate(others), key=key)[1]


def with_measured_speeds(workers: Sequence[WorkerSnapshot]) -> list[WorkerSnapshot]:
    """A worker that has not measured its prefill rates or decode step yet (it just joined,
    or never prefilled or decoded) is taken to be as fast as the fastest that has: an
    unmeasured rate read as the default would send every prefill to the first worker that
    measured one, and an unknown step would read as a worker with room for any batch."""
    rate = max((w.prefill_tokens_per_s for w in workers), default=0.0)
    alone = max((w.prefill_alone_tokens_per_s for w in workers), default=0.0)
    step = min((w.step_s for w in workers if w.step_s > 0), default=0.0)
    return [w if ((w.prefill_tokens_per_s or not rate) and (w.step_s or not step)
                  and (w.prefill_alone_tokens_per_s or not alone))
            else replace(w, prefill_tokens_per_s=w.prefill_tokens_per_s or rate,
                         prefill_alone_tokens_per_s=w.prefill_alone_tokens_per_s or alone,
                         step_s=w.step_s or step)
            for w in workers]


def place(workers: Sequence[WorkerSnapshot], prompt_tokens: int, config: PlacementConfig,
          prefill_lane: frozenset[str] | None = None) -> Placement:
    """Where a request of ``prompt_tokens`` (an estimate) runs; the module docstring gives
    the rules. ``prefill_lane``: the lane plan's workers kept free of streams
    (``proxy/lanes.py``; None: no plan). Raises ``NoPlacementError`` when no worker can
    decode it."""
    workers = with_measured_speeds(workers)
    decode = choose_decode(workers, prompt_tokens, config, prefill_lane)
    prefill = choose_prefill(workers, decode, prompt_tokens, config, prefill_lane)
    local_s = prefill_finish_s(decode, prompt_tokens, config)

    def local(reason: str) -> Placement:
        return Placement(PLACEMENT_LOCAL, decode.worker_id, None, reason, local_s)

    def moved(reason: str) -> Placement:
        assert prefill is not None
        return Placement(PLACEMENT_DISAGGREGATED, decode.worker_id, prefill.worker_id, reason,
                         prefill_finish_s(prefill, prompt_tokens, config)
                         + config.transfer_overhead_s)

    if not decode.can(CAP_WHOLE):
        return moved(REASON_NO_WHOLE) if prefill is not None else local(REASON_NO_PREFILL)
    if uncached_tokens(decode, prompt_tokens) <= config.short_prompt_tokens:
        return local(REASON_SHORT if prompt_tokens <= config.short_prompt_tokens
                     else REASON_CACHED)
    if prefill is None:
        return local(REASON_NO_PREFILL)
    remote_s = prefill_finish_s(prefill, prompt_tokens, config) + config.transfer_overhead_s
    if harm(prefill) < harm(decode) and remote_s <= max(local_s, config.slo_ttft_s):
        return moved(REASON_TPOT)
    if remote_s < local_s:
        return moved(REASON_TTFT if local_s > config.slo_ttft_s else REASON_SOONER)
    if (prefill_lane and decode.worker_id not in prefill_lane
            and in_prefill_lane(prefill, prefill_lane) and harm(prefill) <= harm(decode)
            and remote_s <= config.lane_ttft_share * config.slo_ttft_s):
        # The plan keeps the decode lane's steps to its decodes: a prompt computed there
        # would run every step to the target (and hold its streams longer), so it goes to
        # the lane while the lane meets the TTFT target, even when D is sooner.
        return moved(REASON_LANE)
    return local(REASON_LOCAL)
