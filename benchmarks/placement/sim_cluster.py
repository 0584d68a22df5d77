"""A discrete-event model of a pdserve cluster, for the placement policy. CPU, no engine.

Each worker is an engine as ``engine_core/sched/scheduler.py`` runs it: a step carries every
running decode plus prefill chunks (FCFS) up to ``max_num_batched_tokens``; a step takes
``base + per_seq * batch + per_ctx_token * context`` while it decodes, plus the time its
prefill tokens take at the prefill rate beyond ``base`` (a chunk's compute hides the
weights' read it shares with the decodes, as ``engine_core/step_rates.py`` models it; a
mixed step's chunk runs at ``chunk_rate_share`` of the rate of prompts alone). With a
decode-step target (the adaptive layout's workers, as ``pdserve launch`` starts them) a step with decodes takes only the prompt tokens the
engine's ``mixed_step_prefill_budget`` gives from the worker's measured ``StepRates``. A
prefill for another worker hands its first token to the client when it ends (the
first-token handoff) and its KV lands on the decoding worker ``transfer_s`` later. Layouts:
``replicas`` (round robin, whole requests), ``xPyD`` (round robin per role) and
``adaptive``, which asks the real ``proxy.placement.place`` with the snapshot fields the
proxy fills (``proxy/placer.py``): heartbeat numbers a heartbeat old, the proxy's own
pending prefill tokens and legs in flight.

It is a model: its figures are predictions, never measurements.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE, CAPABILITIES
from engine_core.step_rates import StepRates, extrapolated_step, mixed_step_prefill_budget
from proxy.lanes import LaneConfig, LanePlanner
from proxy.placement import PlacementConfig, WorkerSnapshot, place


@dataclass(frozen=True)
class GpuModel:
    """One worker's speed. Defaults: dummy Qwen3-8B bf16 on an H100 (~41k prompt tokens/s),
    the decode step fitted to the TPOT that 1P1D serves 2k/256 at (the placement sweep on
    H100s: p50 9.8 / 11.2 / 13.9 ms at 11.2 / 14 / 17.5 req/s), serving overheads included.
    A mixed step pays the weights' read once (``engine_core/step_rates.py``)."""

    prefill_tokens_per_s: float = 41_000.0
    # A mixed step's prompt tokens run at this share of the rate of prompts alone (its
    # chunks are small: on H200s at a 9 ms step target, 0.39-0.46).
    chunk_rate_share: float = 1.0
    step_base_s: float = 0.0060
    step_per_seq_s: float = 1.0e-5
    step_per_ctx_token_s: float = 6.5e-8
    kv_capacity_tokens: int = 350_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    transfer_s: float = 0.003          # P's last chunk to D's blocks holding the KV
    heartbeat_s: float = 1.0
    block_size: int = 16

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """A step's time without its prefill tokens (the fixed part is in every step)."""
        return (self.step_base_s + self.step_per_seq_s * batch
                + self.step_per_ctx_token_s * context_tokens)


# Cards the simulator knows. ``h200``: one H200's engine as ``experiments/step_rates_probe.py``
# read it (2026-11-29: prompts alone 44k tokens/s, mixed steps' chunks 0.45 of that at a
# 9 ms step target, a 4.3 ms fixed part and 120 us a decode row at ~2k of context), and room
# for about 650k tokens of Qwen3-8B KV.
GPU_MODELS = {
    "h100": GpuModel(),
    "h200": GpuModel(prefill_tokens_per_s=44_000.0, chunk_rate_share=0.45, step_base_s=0.0043,
                     step_per_seq_s=1.0e-5, step_per_ctx_token_s=5.0e-8,
                     kv_capacity_tokens=650_000),
}


@dataclass
class SimRequest:
    """One request and what happened to it (times in seconds from the start)."""

    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None:
            return None
        return 0.0 if self.output <= 1 else (self.finish - self.first_token) / (self.output - 1)


@dataclass
class _Prefill:
    request: SimRequest
    remaining: int
    decode: SimWorker | None      # None: served whole here


@dataclass
class _Heartbeat:
    num_decoding: int = 0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    step_s: float = 0.0
    kv_usage: float = 0.0
    base_s: float = 0.0
    hidden_s: float = 0.0
    prefill_alone_tokens_per_s: float = 0.0
    per_row_s: float = 0.0


@dataclass(eq=False)
class SimWorker:
    """One engine: a prefill queue, running decodes, KV accounting, measured rates."""

    name: str
    capabilities: frozenset[str]
    gpu: GpuModel
    step_target_s: float | None = None  # --decode-step-target-ms
    prefills: deque[_Prefill] = field(default_factory=deque)
    landed: deque[SimRequest] = field(default_factory=deque)
    finishing: list[tuple[int, int, SimRequest]] = field(default_factory=list)  # heap
    steps: int = 0
    prompt_sum: int = 0          # context = prompt_sum + steps * batch - joined_sum
    joined_sum: int = 0
    kv_tokens: int = 0           # reserved: prompt + output of each request held
    busy: bool = False
    rates: StepRates = field(default_factory=StepRates)
    heartbeat: _Heartbeat = field(default_factory=_Heartbeat)
    # The proxy's own accounting of this worker.
    pending_prefill_tokens: int = 0
    legs_decoding: int = 0
    on_finish: Callable[[int], None] | None = None  # the lane planner's observe_output

    @property
    def batch(self) -> int:
        return len(self.finishing)

    def queued_tokens(self) -> int:
        return sum(p.remaining for p in self.prefills)

    def beat(self) -> None:
        self.heartbeat = _Heartbeat(
            self.batch, self.queued_tokens(), self.rates.prefill_tokens_per_s,
            self.rates.decode_part_s(self.batch), min(1.0, self.kv_tokens / self.gpu.kv_capacity_tokens),
            self.rates.decode_base_s, self.rates.hidden_s, self.rates.prefill_alone_tokens_per_s,
            self.rates.decode_per_row_s)

    def join(self, request: SimRequest, tokens_left: int, now: float) -> None:
        """A request that holds its first token decodes the rest from the next step."""
        if tokens_left <= 0:
            self._finish(request, now)
            return
        heapq.heappush(self.finishing, (self.steps + tokens_left, id(request), request))
        self.prompt_sum += request.prompt + 1
        self.joined_sum += self.steps

    def _finish(self, request: SimRequest, now: float) -> None:
        request.finish = now
        if self.on_finish is not None:
            self.on_finish(request.output)
        self.kv_tokens -= request.prompt + request.output
        self.legs_decoding -= 1

    def plan_step(self) -> tuple[float, list[tuple[_Prefill, int]]]:
        """The next step's duration and the prefill chunks it carries."""
        started = sum(1 for job in self.prefills if job.remaining < job.request.prompt)
        while self.landed and self.batch + started < self.gpu.max_num_seqs:
            request = self.landed.popleft()
            self.join(request, request.output - 1, 0.0)
        batch = self.batch
        budget = self.gpu.max_num_batched_tokens - batch
        capped = mixed_step_prefill_budget(self.step_target_s, self.rates,
                                           self.gpu.block_size, batch) if batch else None
        if capped is not None:
            budget = min(budget, capped)
        chunks = []
        for job in self.prefills:
            fresh = job.remaining == job.request.prompt
            if budget <= 0 or (fresh and batch + started >= self.gpu.max_num_seqs):
                break
            started += fresh
            take = min(job.remaining, budget)
            chunks.append((job, take))
            budget -= take
        prefill_tokens = sum(take for _, take in chunks)
        context = self.prompt_sum + self.steps * batch - self.joined_sum
        rate = self.gpu.prefill_tokens_per_s * (self.gpu.chunk_rate_share if batch else 1.0)
        seconds = self.gpu.decode_step_s(batch, context) + max(
            0.0, prefill_tokens / rate - self.gpu.step_base_s)
        self.rates.observe(seconds, prefill_tokens, batch)
        return seconds, chunks


class SimCluster:
    """Workers, an event queue and a placement rule (``layout``): replicas, xPyD, adaptive."""

    def __init__(self, layout: str, num_workers: int, gpu: GpuModel,
                 config: PlacementConfig | None = None, num_prefill: int = 0,
                 lanes: LaneConfig | None = None) -> None:
        self.layout, self.gpu = layout, gpu
        self.config = config or PlacementConfig()
        if layout == "replicas":
            caps = [frozenset({CAP_WHOLE})] * num_workers
        elif layout == "pd":
            caps = ([frozenset({CAP_PREFILL})] * num_prefill
                    + [frozenset({CAP_DECODE})] * (num_workers - num_prefill))
        elif layout == "adaptive":
            caps = [frozenset(CAPABILITIES)] * num_workers
        else:
            raise ValueError(f"unknown layout {layout!r}")
        target = self.config.decode_step_target_s if layout == "adaptive" else None
        self.workers = [SimWorker(f"w{i}", c, gpu, target) for i, c in enumerate(caps)]
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._turn = itertools.count()
        self.now = 0.0
        self.placements: dict[str, int] = {}
        # The adaptive layout plans lanes as the proxy does (``proxy/placer.py``).
        self.planner = LanePlanner(lanes) if layout == "adaptive" else None
        for worker in self.workers if self.planner is not None else ():
            worker.on_finish = self.planner.observe_output
        self.lane_sizes: dict[int, int] = {}

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (at, next(self._seq), kind, payload))

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        """Serve ``requests`` (sorted by arrival) to the end; returns them, filled in."""
        for request in requests:
            self._push(request.arrival, "arrival", request)
        for index, worker in enumerate(self.workers):
            self._push(index * self.gpu.heartbeat_s / len(self.workers), "beat", worker)
        pending = len(requests)
        while self.events and pending:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrival":
                self._place(payload)  # type: ignore[arg-type]
            elif kind == "step":
                pending -= self._step_done(*payload)  # type: ignore[misc]
            elif kind == "landed":
                worker, request = payload  # type: ignore[misc]
                worker.landed.append(request)
                self._kick(worker)
            elif kind == "beat":
                payload.beat()  # type: ignore[attr-defined]
                self._push(self.now + self.gpu.heartbeat_s, "beat", payload)
        return requests

    def _kick(self, worker: SimWorker) -> None:
        if worker.busy or not (worker.prefills or worker.landed or worker.finishing):
            return
        seconds, chunks = worker.plan_step()
        worker.busy = True
        self._push(self.now + seconds, "step", (worker, chunks))

    def _step_done(self, worker: SimWorker, chunks: list[tuple[_Prefill, int]]) -> int:
        """Apply a finished step; returns how many requests it finished."""
        worker.busy = False
        worker.steps += 1
        done = 0
        while worker.finishing and worker.finishing[0][0] <= worker.steps:
            _, _, request = heapq.heappop(worker.finishing)
            worker.prompt_sum -= request.prompt + 1
            worker.joined_sum -= worker.steps - (request.output - 1)
            worker._finish(request, self.now)
            done += 1
        for job, take in chunks:
            job.remaining -= take
            if job.remaining:
                continue
            worker.prefills.remove(job)
            worker.pending_prefill_tokens -= job.request.prompt
            job.request.first_token = self.now
            if job.decode is None:
                worker.join(job.request, job.request.output - 1, self.now)
                done += job.request.finish is not None
            else:
                worker.kv_tokens -= job.request.prompt
                if job.request.output <= 1:
                    job.decode._finish(job.request, self.now)
                    done += 1
                else:
                    self._push(self.now + self.gpu.transfer_s, "landed",
                               (job.decode, job.request))
        self._kick(worker)
        return done

    def _place(self, request: SimRequest) -> None:
        decode, prefill = self._route(request)
        decode.legs_decoding += 1
        decode.kv_tokens += request.prompt + request.output
        target = prefill or decode
        if prefill is not None:
            prefill.kv_tokens += request.prompt
        target.pending_prefill_tokens += request.prompt
        target.prefills.append(_Prefill(request, request.prompt,
                                        decode if prefill is not None else None))
        self._kick(target)

    def _route(self, request: SimRequest) -> tuple[SimWorker, SimWorker | None]:
        turn = next(self._turn)
        if self.layout == "replicas":
            return self.workers[turn % len(self.workers)], None
        if self.layout == "pd":
            ps = [w for w in self.workers if CAP_PREFILL in w.capabilities]
            ds = [w for w in self.workers if CAP_DECODE in w.capabilities]
            return ds[turn % len(ds)], ps[turn % len(ps)]
        workers = self.workers[turn % len(self.workers):] + self.workers[
            :turn % len(self.workers)]
        snapshots = [self.snapshot(w) for w in workers]
        lane = None
        if self.planner is not None:
            self.planner.observe_prompt(request.prompt)
            lane = self.planner.lane(self.now, snapshots, self.config)
            size = -1 if lane is None else len(lane)
            self.lane_sizes[size] = self.lane_sizes.get(size, 0) + 1
        decision = place(snapshots, request.prompt, self.config, lane)
        key = f"{decision.placement}/{decision.reason}"
        self.placements[key] = self.placements.get(key, 0) + 1
        by_name = {w.name: w for w in workers}
        return by_name[decision.decode], (by_name[decision.prefill] if decision.prefill
                                          else None)

    def snapshot(self, worker: SimWorker) -> WorkerSnapshot:
        """What ``proxy/placer.py`` would see of ``worker`` now."""
        beat = worker.heartbeat
        batch = max(beat.num_decoding, worker.legs_decoding)
        return WorkerSnapshot(
            worker_id=worker.name, capabilities=worker.capabilities,
            queued_prefill_tokens=max(beat.queued_prefill_tokens,
                                      worker.pending_prefill_tokens),
            prefill_tokens_per_s=beat.prefill_tokens_per_s,
            decode_batch=batch, kv_usage=beat.kv_usage,
            step_s=extrapolated_step(beat.step_s, beat.per_row_s, beat.num_decoding, batch),
            decode_step_target_s=worker.step_target_s or 0.0, decode_base_s=beat.base_s,
            decode_hidden_s=beat.hidden_s, num_decoding=beat.num_decoding,
            prefill_alone_tokens_per_s=beat.prefill_alone_tokens_per_s,
            decode_per_row_s=beat.per_row_s)
