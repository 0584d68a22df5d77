"""Lanes: how many workers the cluster keeps free of streams, from the measured traffic.

Placement (``proxy/placement.py``) puts each request where it costs least. What it cannot
see from one request is the cluster's shape: a worker that carries decode streams prefills
only in the time its step target leaves beside them, so where the next stream goes when the
decoding workers are full decides whether the cluster keeps its prefill capacity or its
decode room. That choice is a property of the traffic, not of one request.

The planner makes it like an operator sizing a static split, from measurements, and keeps
re-making it as the traffic changes: for each ``k`` (workers in the *prefill lane*, which
take no new streams while the plan holds) it finds the highest request rate the cluster
sustains (``sustainable``, ``max_rate``):

- the decode lane (``n - k`` workers) carries the streams evenly: a request decodes
  ``output_tokens`` steps, so a worker holds ``rate * output_tokens * step / (n - k)``
  streams and steps in ``base + per_stream * streams``, within the decode-step limit;
- ``k = 0``: every worker prefills beside its decodes, its steps running to the target, at
  ``engine_core.step_rates.prefill_rate_beside_decodes`` from the marginal rate of mixed
  steps; ``k > 0``: the prefill lane prefills at the rate of steps without decodes (whole
  prompts batched: on an H200 over twice the marginal rate of a mixed step's chunks);
- a prefill queue may be as busy as keeps its tail within the TTFT target
  (``prefill_utilisation_limit``).

Prompt and output tokens per request come from the last ``window_requests`` placed prompts
and finished streams; the speeds from the workers' heartbeats. The plan with the highest
sustainable rate wins; the current plan is kept unless another beats it by
``switch_margin`` in ``confirm_replans`` replans in a row, and for at least ``hold_s`` after
a change (a plan change moves no stream: those running finish where they are).

Pure functions plus one small stateful ``LanePlanner`` the placer owns.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_core.cluster.messages import CAP_PREFILL
from engine_core.step_rates import prefill_rate_beside_decodes
from proxy.placement import PlacementConfig, WorkerSnapshot, with_measured_speeds


@dataclass(frozen=True)
class LaneConfig:
    """The planner's constants (docs/design/placement.md says why each has its value)."""

    # Busy share of the prefill capacity a plan is sized to: TTFT grows without bound as
    # the prefill queues approach full use.
    max_prefill_utilisation: float = 0.95
    # A prefill queue's tail wait over its mean (``prefill_utilisation_limit``).
    ttft_tail_factor: float = 3.0
    # Traffic averages cover the last this many requests.
    window_requests: int = 64
    # A new plan must sustain this much more than the current one to replace it.
    switch_margin: float = 0.1
    # Requests placed and streams finished before the planner acts (before: no plan,
    # placement alone decides).
    min_requests: int = 8
    # The plan is re-chosen at most this often (a heartbeat: its inputs change no faster).
    replan_s: float = 1.0
    # Another lane size replaces the plan only after winning this many replans in a row
    # and once the plan has held ``hold_s``: one heartbeat's noise is not a change in the
    # traffic, and each change costs (a worker joining the lane mixes until its streams end).
    confirm_replans: int = 3
    hold_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.max_prefill_utilisation <= 1:
            raise ValueError("max_prefill_utilisation must be in (0, 1]")
        if not (1 <= self.min_requests <= self.window_requests and self.switch_margin >= 0
                and self.replan_s >= 0 and self.confirm_replans >= 1 and self.hold_s >= 0):
            raise ValueError("need 1 <= min_requests <= window_requests, switch_margin >= 0, "
                             "replan_s >= 0, confirm_replans >= 1 and hold_s >= 0")


@dataclass(frozen=True)
class Traffic:
    """Per request averages of what the proxy placed: prompt tokens to compute, and decode
    steps (output tokens) per request."""

    prompt_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class ClusterSpeed:
    """One worker's speed (the cluster's workers are alike): prefill rate beside decodes
    (marginal, in mixed steps) and without them (0: taken as the first), decode step
    ``base_s + per_stream_s * streams``, the engines' decode-step target and the
    decode-step limit the placement holds streams to, and the part of a decode step a
    prompt chunk beside it hides (``engine_core.step_rates.StepRates.hidden_s``)."""

    prefill_tokens_per_s: float
    base_s: float
    per_stream_s: float
    step_target_s: float
    step_limit_s: float
    hidden_s: float = 0.0
    prefill_alone_tokens_per_s: float = 0.0

    @property
    def lane_rate(self) -> float:
        """Prompt tokens/s of a worker in the prefill lane."""
        return self.prefill_alone_tokens_per_s or self.prefill_tokens_per_s


def decode_step(speed: ClusterSpeed, traffic: Traffic, rate: float, decoders: int) -> float:
    """The decode lane's step at ``rate`` requests/s spread over ``decoders`` workers. Each
    request decodes ``output_tokens`` steps, so a worker holds ``b = rate * output_tokens *
    step / decoders`` streams (Little's law) and steps in ``base + per_stream * b``: the
    fixed point, or ``inf`` when streams arrive faster than the steps can end them."""
    inflow = rate * traffic.output_tokens / max(decoders, 1)  # streams per second of step
    room = 1.0 - inflow * speed.per_stream_s
    if decoders <= 0 or room <= 0:
        return math.inf
    return speed.base_s / room


def prefill_utilisation_limit(service_s: float, ttft_s: float, config: LaneConfig) -> float:
    """The busy share a prefill queue may reach and still meet ``ttft_s``: an M/D/1 queue
    waits ``rho / (2 (1 - rho))`` service times on average, and its tail about
    ``ttft_tail_factor`` times the mean; 0 when one prompt alone misses the target."""
    room = ttft_s / (config.ttft_tail_factor * service_s) - 1.0
    if room <= 0:
        return 0.0
    return min(config.max_prefill_utilisation, 2 * room / (1 + 2 * room))


def sustainable(speed: ClusterSpeed, traffic: Traffic, config: LaneConfig, ttft_s: float,
                workers: int, prefill_lane: int, rate: float) -> bool:
    """Whether ``workers`` with ``prefill_lane`` of them free of streams serve ``rate``.

    Without a prefill lane every worker prefills beside its decodes: its steps run to the
    step target, so each of its streams waits a whole target per token and the decode part
    grows with them. With one, the decode lane steps at its decode part alone and the
    prefill lane prefills at its rate without decodes (what the decode lane computes itself
    is slack)."""
    if prefill_lane == 0:
        inflow = rate * traffic.output_tokens / workers
        step = speed.base_s + speed.per_stream_s * inflow * speed.step_target_s
        if step > speed.step_limit_s:
            return False
        rate_each = prefill_rate_beside_decodes(speed.prefill_tokens_per_s, step,
                                                speed.step_target_s, speed.hidden_s)
        servers = workers
    else:
        if decode_step(speed, traffic, rate, workers - prefill_lane) > speed.step_limit_s:
            return False
        rate_each, servers = speed.lane_rate, prefill_lane
    if rate_each <= 0:
        return False
    limit = prefill_utilisation_limit(traffic.prompt_tokens / rate_each, ttft_s, config)
    return rate * traffic.prompt_tokens <= limit * servers * rate_each


def max_rate(speed: ClusterSpeed, traffic: Traffic, config: LaneConfig, ttft_s: float,
             workers: int, prefill_lane: int) -> float:
    """The highest request rate (requests/s) the plan sustains (bisection; 0: none)."""
    low, high = 0.0, 1.0
    while sustainable(speed, traffic, config, ttft_s, workers, prefill_lane, high) and high < 1e6:
        low, high = high, high * 2
    for _ in range(40):
        middle = (low + high) / 2
        if sustainable(speed, traffic, config, ttft_s, workers, prefill_lane, middle):
            low = middle
        else:
            high = middle
    return low


def best_lane_size(rates: Sequence[float], current: int, switch_margin: float) -> int:
    """The prefill lane's size from each size's sustainable rate (``max_rate``): the
    highest, ``current`` unless another beats it by ``switch_margin``."""
    best = max(range(len(rates)), key=lambda k: (rates[k], -abs(k - current)))
    if 0 <= current < len(rates) and rates[best] <= rates[current] * (1 + switch_margin):
        return current
    return best


# Workers with fewer decodes say little about how a step grows with its batch (their
# step is mostly its fixed part and the readings' noise).
MIN_GROWTH_STREAMS = 4
# The newest reading's share of the planner's average step growth per stream.
GROWTH_WEIGHT = 0.2


def measured_speed(workers: Sequence[WorkerSnapshot],
                   step_limit_s: float) -> ClusterSpeed | None:
    """The cluster's speed from its workers' heartbeats: the mean prefill rates and step
    base, the decode step's growth per stream (the workers' measured growth per decode row;
    from engines that do not report one, the decoding workers' step over their base, per
    decode); None until each is measured and a worker has a step target.
    Each prefill rate stands in for the other until a worker measures it (a cluster whose
    workers never mixed, or never prefilled without decodes)."""
    alone = [w.prefill_alone_tokens_per_s for w in workers if w.prefill_alone_tokens_per_s > 0]
    rates = [w.prefill_tokens_per_s for w in workers if w.prefill_tokens_per_s > 0] or alone
    bases = [w.decode_base_s for w in workers if w.decode_base_s > 0]
    targets = [w.decode_step_target_s for w in workers if w.decode_step_target_s > 0]
    if not rates or not bases or not targets:
        return None
    base = sum(bases) / len(bases)
    per_row = [w.decode_per_row_s for w in workers if w.decode_per_row_s > 0]
    if per_row:
        growth = sum(per_row) / len(per_row)
    else:
        decoding = [w for w in workers if w.num_decoding >= MIN_GROWTH_STREAMS and w.step_s > 0]
        streams = sum(w.num_decoding for w in decoding)
        if not streams:
            return None
        growth = sum(max(0.0, w.step_s - (w.decode_base_s or base))
                     for w in decoding) / streams
    hidden = [w.decode_hidden_s for w in workers if w.decode_base_s > 0]
    return ClusterSpeed(sum(rates) / len(rates), base, growth, min(targets),
                        step_limit_s, sum(hidden) / len(hidden),
                        sum(alone) / len(alone) if alone else 0.0)


class LanePlanner:
    """The proxy's current plan: which workers form the prefill lane. ``observe_prompt``
    each placed request, ``observe_output`` each finished stream, ``lane`` before each
    placement. The plan is re-chosen at most every ``replan_s``, and holds while there is
    nothing new to choose from."""

    def __init__(self, config: LaneConfig | None = None) -> None:
        self.config = config or LaneConfig()
        self._prompts: deque[int] = deque(maxlen=self.config.window_requests)
        self._outputs: deque[int] = deque(maxlen=self.config.window_requests)
        self._lane: tuple[str, ...] = ()
        self._planned_at = -math.inf
        self._per_stream_s = 0.0
        self._traffic: Traffic | None = None
        self._rates: list[float] = []  # the last plan's sustainable rate per lane size
        self._changed_at = -math.inf  # when the lane size last changed
        self._candidate: int | None = None  # another size, and the replans it won in a row
        self._wins = 0

    def describe(self) -> dict[str, object]:
        """The plan for /instances: the prefill lane (null: no plan yet), the traffic it was
        chosen for and the request rate each lane size sustains."""
        return {"prefill_lane": list(self._lane) if self._planned_at > -math.inf else None,
                "traffic": None if self._traffic is None else {
                    "prompt_tokens": round(self._traffic.prompt_tokens, 1),
                    "output_tokens": round(self._traffic.output_tokens, 1)},
                "sustainable_rps": [round(rate, 2) for rate in self._rates],
                "observed": {"prompts": len(self._prompts), "outputs": len(self._outputs)}}

    def observe_prompt(self, prompt_tokens: int) -> None:
        """A request was placed with ``prompt_tokens`` to compute."""
        self._prompts.append(prompt_tokens)

    def observe_output(self, output_tokens: int) -> None:
        """A stream ended after ``output_tokens`` tokens."""
        self._outputs.append(output_tokens)

    def traffic(self) -> Traffic | None:
        """The last ``window_requests`` requests' averages (None below ``min_requests``)."""
        if min(len(self._prompts), len(self._outputs)) < self.config.min_requests:
            return None
        return Traffic(sum(self._prompts) / len(self._prompts),
                       sum(self._outputs) / len(self._outputs))

    def lane(self, now: float, workers: Sequence[WorkerSnapshot],
             config: PlacementConfig) -> frozenset[str] | None:
        """The workers that take no new streams now; None while there is no plan yet (too
        few requests or measurements: placement alone decides)."""
        present = {w.worker_id for w in workers}
        kept = [w for w in self._lane if w in present]
        current = frozenset(kept) if self._planned_at > -math.inf else None
        if now - self._planned_at < self.config.replan_s and len(kept) == len(self._lane):
            return current
        workers = with_measured_speeds(workers)
        speed = measured_speed(workers, config.decode_step_limit * config.slo_tpot_s)
        if speed is not None:  # one heartbeat's growth reading is noisy: average them
            if self._per_stream_s:
                self._per_stream_s += GROWTH_WEIGHT * (speed.per_stream_s - self._per_stream_s)
            else:
                self._per_stream_s = speed.per_stream_s
            speed = replace(speed, per_stream_s=self._per_stream_s)
        traffic = self.traffic()
        if speed is None or traffic is None or len(workers) < 2:
            return current
        self._planned_at = now
        self._traffic = traffic
        self._rates = [max_rate(speed, traffic, self.config, config.slo_ttft_s, len(workers), k)
                       for k in range(len(workers))]
        planned = len(self._lane) if current is not None else -1
        size = self._settled(best_lane_size(self._rates, planned, self.config.switch_margin),
                             planned, now)
        kept = kept[:size]
        candidates = sorted((w for w in workers
                             if w.can(CAP_PREFILL) and w.worker_id not in kept),
                            key=lambda w: w.decode_batch)
        kept += [w.worker_id for w in candidates[:size - len(kept)]]
        self._lane = tuple(kept)
        return frozenset(kept)

    def _settled(self, wanted: int, planned: int, now: float) -> int:
        """The lane size to plan: ``wanted`` when there is no plan yet (``planned`` -1) or
        the plan no longer fits the workers; otherwise ``planned`` until ``wanted`` has won
        ``confirm_replans`` replans in a row and the plan has held ``hold_s``."""
        if wanted == planned:
            self._candidate, self._wins = None, 0
            return planned
        if 0 <= planned < len(self._rates):
            self._wins = self._wins + 1 if wanted == self._candidate else 1
            self._candidate = wanted
            if (self._wins < self.config.confirm_replans
                    or now - self._changed_at < self.config.hold_s):
                return planned
        self._candidate, self._wins, self._changed_at = None, 0, now
        return wanted
