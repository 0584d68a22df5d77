"""Continuous-batching scheduler: decides each step's batch as a plain SchedulerOutput.

Order of business each step: running requests first (decodes and unfinished prefill chunks,
in arrival order), preempting the newest running request by recompute when blocks run
out; then landed remote loads (they own all their blocks) and waiting requests FCFS, within
the token budget and ``max_num_seqs``. With a decode-step target, a step that carries decodes
takes prompt tokens (rows of more than one token) only up to what keeps the step within the
target, at least a block (``engine_core/step_rates.py``); a step without decodes is not
bounded by it. Requests whose prompt KV comes from a remote worker
are parked in WAITING_FOR_REMOTE_KV, with blocks for their whole prompt, without blocking
anyone; finished requests whose KV is still being sent keep their blocks until
the connector reports the send done.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.grammar.bitmask import StepMasks
from engine_core.kv_connector import ConnectorScheduler
from engine_core.messages import (
    ITERATION_TOKEN_BUCKETS,
    EngineOutput,
)
from engine_core.request import Request, RequestStatus
from engine_core.sched.kv_cache_manager import KVCacheManager
from engine_core.sched.outputs import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from engine_core.sched.updates import StepUpdates, without_remote_prefill
from engine_core.step_rates import StepRates, mixed_step_prefill_budget

logger = logging.getLogger("pdserve.scheduler")


@dataclass
class SchedulerCounters:
    """Cumulative counters exported as metrics."""

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prompt_tokens: int = 0
    # Steps by their tokens as vLLM counts them (generated, plus the prompts whose prefill
    # ended): ITERATION_TOKEN_BUCKETS, one more for the rest.
    iteration_token_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def count_iteration(self, num_tokens: int) -> None:
        """One step that ran ``num_tokens`` tokens."""
        self.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens


def is_decoding(request: Request) -> bool:
    """A running request decodes once every known token but the last is computed (its
    rows are one token a step)."""
    return request.num_tokens_with_pending - request.num_computed_tokens <= 1


class Scheduler(StepUpdates):
    """Owns request queues and decides what runs; no devices, sockets or threads."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, connector: ConnectorScheduler,
                 max_model_len: int, load_failure_policy: str = "recompute") -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = kv_cache_manager
        self.connector = connector
        self.max_model_len = max_model_len
        self.load_failure_policy = load_failure_policy
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        # Requests whose grammar is still compiling (vLLM's WAITING_FOR_FSM): they join
        # ``waiting`` once it is ready. ``num_constrained`` counts unfinished requests with
        # a grammar, so a batch without one spends nothing on masks.
        self.compiling: dict[str, Request] = {}
        self.num_constrained = 0
        # Parked requests whose KV landed, in landing order: admitted before ``waiting``.
        self.landed: deque[Request] = deque()
        # Finished requests whose blocks stay allocated until the connector sent them.
        self.held: dict[str, Request] = {}
        # Parked request id -> the number of computed tokens once its remote KV has landed.
        self._num_tokens_after_load: dict[str, int] = {}
        self._forget: set[str] = set()
        # Outputs produced outside a model step (aborts, failed loads) wait here.
        self._pending_outputs: list[EngineOutput] = []
        self.counters = SchedulerCounters()
        # Measured by the engine from each step's wall time; bounds mixed steps.
        self.step_rates = StepRates()
        # Finished transfers applied so far: each may free blocks or queue a request, so a
        # pass that follows one may schedule what the pass before could not.
        self.transfer_updates = 0

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; one continuing after output tokens sampled elsewhere finishes
        at once when its last such token ends it (a stop token, max_tokens)."""
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self.num_constrained += 1
        if request.num_output_tokens:
            status = self._check_stop(request, request.token_ids[-1])
            if status is not None:
                self._finish(request, status)
                self._pending_outputs.append(self._make_output(request, []))
                return
        if request.grammar is not None:
            self.compiling[request.request_id] = request
            return
        self.waiting.append(request)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; fail those whose grammar cannot be."""
        ready = [r for r in self.compiling.values()
                 if r.grammar is not None and r.grammar.ready(r.output_token_ids)]
        for request in ready:
            del self.compiling[request.request_id]
            assert request.grammar is not None
            if request.grammar.error is None:
                self.waiting.append(request)
                continue
            self._finish(request, RequestStatus.FINISHED_ERROR)
            self._pending_outputs.append(self._make_output(request, [],
                                                           error=request.grammar.error))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests as aborted wherever they are; unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._remove_from_queues(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(self._make_output(request, []))

    def _remove_from_queues(self, request: Request) -> None:
        if self.compiling.pop(request.request_id, None) is not None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.parked.pop(request.request_id, None)
            self._num_tokens_after_load.pop(request.request_id, None)
        elif request in self.landed:
            self.landed.remove(request)
        else:
            self.waiting.remove(request)

    def has_runnable(self) -> bool:
        """True when a step would schedule tokens (or flush pending outputs)."""
        return bool(self.running or self.waiting or self.landed or self._pending_outputs
                    or self.compiling)

    def has_unfinished(self) -> bool:
        """True while any request holds engine state, including remote waits and held sends."""
        return self.has_runnable() or bool(self.parked or self.held)

    @property
    def num_decoding(self) -> int:
        """Running requests past their prefill."""
        return sum(map(is_decoding, self.running))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.landed) + len(self.compiling)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute here: waiting requests (landed ones only their
        last) and running ones mid-prefill. Requests whose KV a peer sends compute one."""
        def remaining(request: Request) -> int:
            if (request.kv_transfer_params is not None
                    and request.kv_transfer_params.do_remote_prefill):
                return 1  # its prompt's KV comes from the peer that prefills it
            return max(0, request.num_prompt_tokens - request.num_computed_tokens)

        return (sum(map(remaining, self.waiting)) + sum(map(remaining, self.running))
                + len(self.landed))

    # ---- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch."""
        if self.compiling:
            self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        prefill_budget = self.mixed_prefill_budget()  # None: prompt tokens unbounded
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_any = False
        scheduled: dict[str, Request] = {}
        now = time.monotonic()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0 or self._stops_with_pending(request):
                index += 1
                continue
            if num_new > 1 and prefill_budget is not None:
                if prefill_budget <= 0:  # this step's prompt share is spent
                    index += 1
                    continue
                num_new = min(num_new, prefill_budget)
            new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self._preemption_victim(index)
                if victim is None:  # every later request's blocks are pinned by a send
                    break
                self.running.remove(victim)
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            num_scheduled[request.request_id] = num_new
            cached_reqs.append(CachedRequestData(request.request_id, new_block_ids,
                                                 request.num_computed_tokens))
            scheduled[request.request_id] = request
            budget -= num_new
            if num_new > 1 and prefill_budget is not None:
                prefill_budget -= num_new
            index += 1

        # Newly admitted requests must not take the blocks a preemption just freed from an
        # older running request: skip admissions on a step that preempted. Landed remote
        # loads go first: they own blocks for every known token, so admitting them takes no
        # free block, while behind a head that needs blocks they would sit on theirs (a decode
        # worker whose cache landed loads filled would never schedule again).
        while ((self.landed or self.waiting) and budget > 0 and not preempted_any
               and len(self.running) < self.config.max_num_seqs):
            queue = self.landed if self.landed else self.waiting
            request = queue[0]
            hit_blocks, num_local = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_local = self.kv.get_computed_blocks(request)
                match = self.connector.get_num_new_matched_tokens(request, num_local)
                if match.num_tokens > 0 and match.is_async:
                    if not self._park(request, hit_blocks, num_local, match.num_tokens):
                        break
                    continue
            num_computed = request.num_computed_tokens + num_local
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if num_new > 1 and prefill_budget is not None:
                if prefill_budget <= 0:
                    break
                num_new = min(num_new, prefill_budget)
                prefill_budget -= num_new
            if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            queue.popleft()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_local
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.compute_start_time is None:
                request.compute_start_time = now
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
            ))
            scheduled[request.request_id] = request
            budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._forget,
            scheduled_requests=scheduled,
        )
        self._forget = set()
        output.host_copies = self.kv.end_pass()
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._advance_scheduled(output)
        return output

    def mixed_prefill_budget(self) -> int | None:
        """This step's prompt tokens under the decode-step target while requests decode
        (``step_rates.mixed_step_prefill_budget``); None: unbounded."""
        decodes = self.num_decoding
        if self.config.decode_step_target_s is None or not decodes:
            return None
        return mixed_step_prefill_budget(self.config.decode_step_target_s, self.step_rates,
                                         self.block_size, decodes)

    def grammar_masks(self, output: SchedulerOutput, request_ids: list[str]) -> StepMasks | None:
        """The matchers whose masks rows ``0..len(request_ids)`` of ``output``'s sampling take
        (the rest all ones), once the step before is collected; None when no row is
        constrained. A request the step before ended (its grammar complete, a stop token)
        samples a token that is dropped: it needs no mask."""
        if not output.grammar_request_ids:
            return None
        matchers, constrained = [], []
        for row, request_id in enumerate(request_ids):
            request = output.scheduled_requests.get(request_id)
            if (request_id in output.grammar_request_ids and request is not None
                    and request.grammar is not None and not request.is_finished):
                matchers.append(request.grammar.matcher)
                constrained.append(row)
        return StepMasks(matchers, constrained, len(request_ids)) if constrained else None

    def _stops_with_pending(self, request: Request) -> bool:
        """A request whose in-flight tokens certainly end it (length) gets no more steps."""
        if request.num_pending_tokens == 0:
            return False
        max_tokens = request.max_tokens
        return ((max_tokens is not None
                 and request.num_output_tokens + request.num_pending_tokens >= max_tokens)
                or request.num_tokens_with_pending >= self.max_model_len)

    def _advance_scheduled(self, output: SchedulerOutput) -> None:
        """Count the scheduled tokens as computed now, and a step reaching the end of a
        request's known and pending tokens as one more pending sample: the next schedule
        may then run before this step's tokens are read (async scheduling)."""
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = output.scheduled_requests[request_id]
            before = request.num_computed_tokens
            request.num_computed_tokens += num_tokens
            self.counters.computed_prompt_tokens += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - before)
            if request.num_computed_tokens >= request.num_tokens_with_pending:
                request.num_pending_tokens += 1
                if request.grammar is not None:
                    output.grammar_request_ids.add(request_id)

    def _park(self, request: Request, hit_blocks: list, num_local: int,
              num_external: int) -> bool:
        """Allocate blocks for a request whose prompt KV arrives from a remote worker: for
        all its known tokens, the ones it computes itself after the load included, so that
        once landed (``landed``) it needs no new block to be admitted."""
        num_after = request.num_tokens - num_local - num_external
        if self.kv.allocate_slots(request, num_after, hit_blocks,
                                  num_external_tokens=num_external) is None:
            return False
        self.waiting.popleft()
        request.num_cached_tokens = num_local
        request.num_computed_tokens = num_local
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.parked[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_local, num_external)
        self._num_tokens_after_load[request.request_id] = num_local + num_external
        return True

    def _preemption_victim(self, first: int) -> Request | None:
        """The newest running request at ``first`` or later whose blocks the connector does
        not pin.

        Requests before ``first`` are already scheduled in this step: preempting one would
        free blocks its step still writes (another request gets them in the same step) and
        schedule a request the runner is told to forget. Older requests keep priority.
        """
        for position in range(len(self.running) - 1, first - 1, -1):
            request = self.running[position]
            if not self.connector.pins_blocks(request):
                return request
        return None

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it restarts from scratch (recompute)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # an in-flight sample of it is dropped, then recomputed
        request.num_preemptions += 1
        request.kv_transfer_params = without_remote_prefill(request.kv_transfer_params)
        self.counters.num_preemptions += 1
        self._forget.add(request.request_id)
        self.waiting.appendleft(request)
        logger.warning(
            "Sequence group %s is preempted by PreemptionMode.RECOMPUTE mode because there is "
            "not enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_num_cumulative_preemption=%d",
            request.request_id, self.counters.num_preemptions)
