"""Placer: the placement policy wired to the registry (rule 0 of ``proxy/routing.py``).

It builds ``proxy.placement``'s snapshot from what the proxy knows of each worker (its
heartbeat, the proxy's own in-flight accounting, the prefix index), asks the lane planner
which workers to keep free of streams (``proxy/lanes.py``: fed with each placed prompt and
each finished stream's length), asks the policy, and turns the decision into a ``Route``.
It applies only while a worker with capabilities (``ROLE_WORKER``) serves the model; static
P/D and colocated clusters keep their rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_core.cluster.messages import CAP_DECODE, CAP_WHOLE, ROLE_WORKER
from engine_core.errors import NoWorkerError
from engine_core.step_rates import extrapolated_step
from proxy.lanes import LaneConfig, LanePlanner
from proxy.placement import (
    PLACEMENT_DISAGGREGATED,
    NoPlacementError,
    PlacementConfig,
    WorkerSnapshot,
    place,
    uncached_tokens,
)
from proxy.prefix_index import PrefixIndex, PromptShape
from proxy.registry import InstanceRegistry, WorkerState
from proxy.routing import MODE_LOCAL, MODE_PD, Route


class Placer:
    """Places requests over every worker of a model that has capabilities left."""

    def __init__(self, config: PlacementConfig, index: PrefixIndex | None = None,
                 lanes: LaneConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.index = index or PrefixIndex()
        self.planner = LanePlanner(lanes)
        self.clock = clock
        self._turn = 0  # rotates the snapshot so ties go round the workers

    def stream_finished(self, output_tokens: int) -> None:
        """A placed request's stream ended after ``output_tokens`` tokens."""
        self.planner.observe_output(output_tokens)

    def forget(self, worker_id: str) -> None:
        """A worker left: drop what the placer remembers of it."""
        self.index.forget(worker_id)

    def snapshot(self, worker: WorkerState, shape: PromptShape) -> WorkerSnapshot:
        """One worker as the policy sees it: the heartbeat's numbers, or the proxy's own
        where they are fresher (prompt tokens it placed and legs in flight; the decode step
        of that batch, from the heartbeat's step model)."""
        load = worker.load
        decoding = (worker.parts_in_flight.get(CAP_DECODE, 0)
                    + worker.parts_in_flight.get(CAP_WHOLE, 0))
        batch = max(load.num_decoding, decoding)
        return WorkerSnapshot(
            worker_id=worker.worker_id, capabilities=worker.capabilities,
            queued_prefill_tokens=max(load.num_prefill_tokens_queued,
                                      worker.pending_prefill_tokens),
            prefill_tokens_per_s=load.prefill_tokens_per_s,
            prefill_alone_tokens_per_s=load.prefill_alone_tokens_per_s,
            decode_batch=batch, kv_usage=load.kv_cache_usage,
            step_s=extrapolated_step(load.decode_step_s, load.decode_per_row_s,
                                     load.num_decoding, batch),
            decode_step_target_s=load.decode_step_target_s,
            decode_base_s=load.decode_base_s, decode_hidden_s=load.decode_hidden_s,
            num_decoding=load.num_decoding, decode_per_row_s=load.decode_per_row_s,
            cached_tokens=self.index.cached_tokens(worker.worker_id, shape))

    def route(self, registry: InstanceRegistry, model: str | None,
              exclude: frozenset[str] | set[str], shape: PromptShape) -> Route | None:
        """The route of one attempt; None when no worker with capabilities serves ``model``."""
        if not registry.candidates(ROLE_WORKER, model, exclude):
            return None
        workers = [w for w in registry.candidates(None, model, exclude) if w.capabilities]
        turn = self._turn % max(1, len(workers))
        self._turn += 1
        workers = workers[turn:] + workers[:turn]
        snapshots = {w.worker_id: self.snapshot(w, shape) for w in workers}
        lane = self.planner.lane(self.clock(), list(snapshots.values()), self.config)
        try:
            decision = place(list(snapshots.values()), shape.num_tokens, self.config, lane)
        except NoPlacementError:
            raise NoWorkerError("No worker that can decode is available for this request"
                                + (f" (model {model!r})" if model else "") + ".") from None
        by_id = {w.worker_id: w for w in workers}
        prefilling = decision.prefill or decision.decode
        tokens = uncached_tokens(snapshots[prefilling], shape.num_tokens) if shape.num_tokens else 0
        for worker_id in {decision.decode, prefilling}:
            self.index.record(worker_id, shape)
        self.planner.observe_prompt(tokens)
        if decision.placement == PLACEMENT_DISAGGREGATED:
            assert decision.prefill is not None
            return Route(MODE_PD, decode=by_id[decision.decode], prefill=by_id[decision.prefill],
                         placement=decision, prefill_tokens=tokens)
        return Route(MODE_LOCAL, decode=by_id[decision.decode], placement=decision,
                     prefill_tokens=tokens)
