"""Placement: where one request runs, from a snapshot of the workers. Pure.

A worker is a set of capabilities: ``prefill`` (prefills for another worker's decode),
``decode`` (decodes a request prefilled elsewhere), ``whole`` (serves a request from prompt
to last token). ``place`` chooses between serving the request whole on the worker that
decodes it (``local``) and prefilling it on another worker P while D decodes it
(``disaggregated``).

The TPOT a client is held to is a request's mean (``(e2e - ttft) / (tokens - 1)``), so a
worker may prefill beside its decodes as long as the share of its time spent prefilling
(its *prefill duty*: recent and queued prefill seconds per second, over a window of about
one stream's lifetime) stays within its *duty budget*: a stream that sees decode steps of
``step_s`` while the worker prefills a share ``duty`` of the time gets a mean TPOT of about
``step_s / (1 - duty)``, so the budget is ``1 - step_s / (tpot_headroom * slo_tpot_s)``.
A worker that has not measured its speed yet is taken as fast as the fastest that has.

1. D is the decode-capable worker whose decodes are in the best shape: a new stream's mean
   TPOT there (its decode step stretched by the prefill queued there) within the target,
   then a significant cached prefix of this prompt, then its decode batch, then the least
   KV in use (a worker at ``kv_full`` takes new decodes only when every one is). The batch
   counts two ways. When the target is *tight* (the cluster's prefill duty, shared evenly
   over the decode-capable workers, is over a decoding worker's budget), decodes pack
   onto the workers already decoding, which keeps other workers free of decodes to
   prefill for them: the cluster splits itself into prefill and decode workers, as far as
   the load needs. Otherwise they spread (smallest batch first), as replicas do.
2. Serving whole on D is always a candidate, so the cluster never does worse than replicas.
   It is taken when the prompt's uncached part on D is short (``short_prompt_tokens``), or
   no other worker can prefill it.
3. The prefill goes where it finishes first (queued prefill tokens plus this prompt's
   uncached part, over the worker's measured rate; a move pays the transfer's fixed cost)
   among the workers whose duty budget takes it: D itself or the prefill-capable worker P
   that harms the fewest decodes, then finishes first. It moves off D when:
   - ``tpot``: the prefill is over D's duty budget, harms fewer of P's decodes (none,
     mostly), and P still meets the TTFT target (or beats D);
   - ``ttft``: D would miss the TTFT target and P finishes sooner;
   - ``sooner``: P finishes sooner than D by more than the transfer's fixed cost.
   Otherwise it stays (``local_first``).

Ties go to the worker listed first: the caller rotates the list to share work evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE

PLACEMENT_LOCAL = "local"
PLACEMENT_DISAGGREGATED = "disaggregated"

# Reasons (the ``reason`` label of pdserve:proxy_placements_total).
REASON_SHORT = "short"            # uncached part at most short_prompt_tokens: stays on D
REASON_CACHED = "cached"          # long, but D's cached prefix leaves a short part
REASON_LOCAL = "local_first"      # D finishes the prefill first (or equally soon)
REASON_NO_PREFILL = "no_prefill_worker"  # no other worker can prefill for D
REASON_NO_WHOLE = "decode_only"   # D cannot serve whole requests: it must get the KV
REASON_TPOT = "tpot"              # D's decodes would break the TPOT target
REASON_TTFT = "ttft"              # D would miss the TTFT target, P is sooner
REASON_SOONER = "sooner"          # P finishes the prefill sooner than D
REASONS = (REASON_SHORT, REASON_CACHED, REASON_LOCAL, REASON_NO_PREFILL, REASON_NO_WHOLE,
           REASON_TPOT, REASON_TTFT, REASON_SOONER)


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
    # The span a stream's mean TPOT averages prefill stalls over: about one stream's
    # lifetime (256 tokens of ~12 ms). Prefill seconds placed on a worker count in its duty
    # for about this long.
    duty_window_s: float = 3.0
    # The share of the TPOT target the policy plans to: the rest absorbs bursts, heartbeats
    # a second old and decode steps growing with the batch.
    tpot_headroom: float = 0.8

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s", "default_prefill_tokens_per_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number > 0")
        if self.short_prompt_tokens < 0:
            raise ValueError("short_prompt_tokens must be >= 0")
        if not 0 <= self.transfer_overhead_s < math.inf or not 0 < self.kv_full <= 1:
            raise ValueError("transfer_overhead_s must be >= 0 and kv_full in (0, 1]")
        if not 0 < self.duty_window_s < math.inf or not 0 < self.tpot_headroom <= 1:
            raise ValueError("duty_window_s must be a finite number > 0, tpot_headroom in "
                             "(0, 1]")


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the proxy knows of one worker when a request arrives."""

    worker_id: str
    capabilities: frozenset[str]
    queued_prefill_tokens: int = 0     # prompt tokens waiting to be computed there
    prefill_tokens_per_s: float = 0.0  # measured rate; 0: not measured yet
    decode_batch: int = 0              # requests decoding there
    kv_usage: float = 0.0              # 0..1
    step_s: float = 0.0                # its current decode step (the TPOT it gives); 0: unknown
    cached_tokens: int = 0             # this prompt's prefix already in its cache (estimate)
    prefill_duty: float = 0.0          # recent and queued prefill seconds per second there

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


def _rate(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    return worker.prefill_tokens_per_s or config.default_prefill_tokens_per_s


def uncached_tokens(worker: WorkerSnapshot, prompt_tokens: int) -> int:
    """The prompt tokens ``worker`` would compute (at least the last one, which samples)."""
    return max(1, prompt_tokens - worker.cached_tokens)


def prefill_finish_s(worker: WorkerSnapshot, prompt_tokens: int,
                     config: PlacementConfig) -> float:
    """Predicted seconds until ``worker`` has this prompt's KV: its queue, then the prompt."""
    work = worker.queued_prefill_tokens + uncached_tokens(worker, prompt_tokens)
    return work / _rate(worker, config)


def prefill_seconds(worker: WorkerSnapshot, prefill_tokens: int,
                    config: PlacementConfig) -> float:
    """Seconds of ``worker``'s time that ``prefill_tokens`` of prompt take."""
    return prefill_tokens / _rate(worker, config)


def planned_tpot_s(config: PlacementConfig) -> float:
    """The mean TPOT the policy plans to: the target less its headroom."""
    return config.tpot_headroom * config.slo_tpot_s


def duty_budget(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    """The prefill duty ``worker`` can carry while its streams keep a mean TPOT within the
    planned TPOT: ``1 - step / planned`` (<= 0 when its steps alone miss it)."""
    return 1.0 - worker.step_s / planned_tpot_s(config)


def duty_with(worker: WorkerSnapshot, prefill_tokens: int, config: PlacementConfig) -> float:
    """``worker``'s prefill duty once it takes ``prefill_tokens`` more."""
    return (worker.prefill_duty
            + prefill_seconds(worker, prefill_tokens, config) / config.duty_window_s)


def mean_tpot_s(worker: WorkerSnapshot, duty: float) -> float:
    """The mean TPOT of ``worker``'s streams while it prefills a share ``duty`` of its time."""
    return math.inf if duty >= 1.0 else worker.step_s / (1.0 - duty)


def breaks_tpot(worker: WorkerSnapshot, prefill_tokens: int, config: PlacementConfig) -> bool:
    """True when ``worker`` has decodes running and a prefill there takes its duty over its
    budget (its streams' mean TPOT toward the target)."""
    return (worker.decode_batch > 0
            and duty_with(worker, prefill_tokens, config) > duty_budget(worker, config))


def harm(worker: WorkerSnapshot, prefill_tokens: int, config: PlacementConfig) -> int:
    """Decode streams pushed toward the TPOT target by a prefill on ``worker``."""
    return worker.decode_batch if breaks_tpot(worker, prefill_tokens, config) else 0


def is_tight(workers: Sequence[WorkerSnapshot], config: PlacementConfig) -> bool:
    """The cluster's prefill duty, shared evenly over ``workers`` (the decode-capable
    ones), is over the duty budget of a worker decoding: replicas would break the target
    there."""
    decoding = [w for w in workers if w.decode_batch > 0]
    if not decoding:
        return False
    demand = sum(w.prefill_duty for w in workers) / len(workers)
    return demand > min(duty_budget(w, config) for w in decoding)


def committed_duty(worker: WorkerSnapshot, config: PlacementConfig) -> float:
    """The part of ``worker``'s prefill duty a stream starting now surely sees: its queued
    prefill, over the window (what it prefilled before is past; new prefills can go
    elsewhere)."""
    queued = prefill_seconds(worker, worker.queued_prefill_tokens, config)
    return min(worker.prefill_duty, queued / config.duty_window_s)


def _over_tpot_now(worker: WorkerSnapshot, config: PlacementConfig) -> bool:
    """A decode added here misses the TPOT target even without new prefills: its steps,
    stretched by the prefill already queued there, are too slow."""
    return mean_tpot_s(worker, committed_duty(worker, config)) > config.slo_tpot_s


def choose_decode(workers: Sequence[WorkerSnapshot], prompt_tokens: int,
                  config: PlacementConfig) -> WorkerSnapshot:
    """Rule 1: the decode-capable worker in the best shape to take one more stream."""
    decoders = [w for w in workers if w.can(CAP_DECODE) or w.can(CAP_WHOLE)]
    if not decoders:
        raise NoPlacementError("no worker can decode this request")
    roomy = [w for w in decoders if w.kv_usage < config.kv_full] or decoders
    pack = -1 if is_tight(decoders, config) else 1

    def key(item: tuple[int, WorkerSnapshot]) -> tuple[bool, int, float, float, int]:
        index, worker = item
        cached = worker.cached_tokens if worker.cached_tokens > config.short_prompt_tokens else 0
        over = _over_tpot_now(worker, config)
        # Over the target everywhere: the least slow takes it (packing would pile on).
        shape = (mean_tpot_s(worker, committed_duty(worker, config)) if over
                 else pack * worker.decode_batch)
        return (over, -min(cached, prompt_tokens), shape, worker.kv_usage, index)

    return min(enumerate(roomy), key=key)[1]


def choose_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot,
                   prompt_tokens: int, config: PlacementConfig) -> WorkerSnapshot | None:
    """The prefill-capable worker other than ``decode`` whose prefill pushes the fewest
    decodes over the TPOT target, then finishes first; None when there is none."""
    others = [w for w in workers if w.can(CAP_PREFILL) and w.worker_id != decode.worker_id]
    if not others:
        return None

    def key(item: tuple[int, WorkerSnapshot]) -> tuple[int, float, int, int]:
        index, worker = item
        return (harm(worker, uncached_tokens(worker, prompt_tokens), config),
                prefill_finish_s(worker, prompt_tokens, config), worker.decode_batch, index)

    return min(enumerate(others), key=key)[1]


def with_measured_speeds(workers: Sequence[WorkerSnapshot]) -> list[WorkerSnapshot]:
    """A worker that has not measured its prefill rate or decode step yet (it just joined,
    or never prefilled or decoded) is taken to be as fast as the fastest that has: an
    unmeasured rate read as the default would send every prefill to the first worker that
    measured one, and an unknown step would hide the prefill queued there from a new
    stream's mean TPOT."""
    rate = max((w.prefill_tokens_per_s for w in workers), default=0.0)
    step = min((w.step_s for w in workers if w.step_s > 0), default=0.0)
    return [w if (w.prefill_tokens_per_s or not rate) and (w.step_s or not step)
            else replace(w, prefill_tokens_per_s=w.prefill_tokens_per_s or rate,
                         step_s=w.step_s or step)
            for w in workers]


def place(workers: Sequence[WorkerSnapshot], prompt_tokens: int,
          config: PlacementConfig) -> Placement:
    """Where a request of ``prompt_tokens`` (an estimate) runs; the module docstring gives
    the rules. Raises ``NoPlacementError`` when no worker can decode it."""
    workers = with_measured_speeds(workers)
    decode = choose_decode(workers, prompt_tokens, config)
    prefill = choose_prefill(workers, decode, prompt_tokens, config)
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
    local_work = uncached_tokens(decode, prompt_tokens)
    if local_work <= config.short_prompt_tokens:
        return local(REASON_SHORT if prompt_tokens <= config.short_prompt_tokens
                     else REASON_CACHED)
    if prefill is None:
        return local(REASON_NO_PREFILL)
    remote_s = prefill_finish_s(prefill, prompt_tokens, config) + config.transfer_overhead_s
    prefill_work = uncached_tokens(prefill, prompt_tokens)
    if (harm(prefill, prefill_work, config) < harm(decode, local_work, config)
            and remote_s <= max(local_s, config.slo_ttft_s)):
        return moved(REASON_TPOT)
    if remote_s < local_s:
        return moved(REASON_TTFT if local_s > config.slo_ttft_s else REASON_SOONER)
    return local(REASON_LOCAL)
