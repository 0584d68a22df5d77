"""The scheduler's update after each step: progress advanced, sampled tokens appended, stops
checked, finished requests' blocks handed back (or kept while their KV is sent), and the
client outputs built; a remote load that landed or failed rejoins the queues.

A mixin of ``Scheduler`` (``scheduler.py``), which decides the steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from engine_core.kv_connector import FinishedTransfers
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.messages import EngineOutput, RequestTimings, TokenLogprob
from engine_core.request import Request, RequestStatus
from engine_core.sched.outputs import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput

if TYPE_CHECKING:
    from engine_core.sched.scheduler import Scheduler

logger = logging.getLogger("pdserve.scheduler")


class StepUpdates:
    """``Scheduler``'s update of its requests from a step's results."""

    def update_from_output(self: Scheduler, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineOutput]:
        """Advance progress, append sampled tokens, finish requests; return client outputs."""
        outputs, self._pending_outputs = self._pending_outputs, []
        now = time.monotonic()
        logprobs = runner_output.logprobs or [None] * len(runner_output.req_ids)
        scheduled = scheduler_output.scheduled_requests
        # vLLM's iteration tokens: the tokens generated, plus the whole prompt of each request
        # whose prefill ended with this step (its first token).
        iteration_tokens = 0
        for request_id, chunk in runner_output.prompt_logprobs.items():
            request = scheduled.get(request_id)
            if request is not None and self.requests.get(request_id) is request:
                self._add_prompt_logprobs(request, chunk)
        for request_id, sampled, lp in zip(runner_output.req_ids,
                                           runner_output.sampled_token_ids, logprobs):
            request = scheduled.get(request_id)
            # A request that finished, was aborted or preempted after this step was
            # scheduled (or whose id a newer request now holds) drops the token.
            if (request is None or self.requests.get(request_id) is not request
                    or request.status != RequestStatus.RUNNING or not sampled):
                continue
            request.num_pending_tokens -= len(sampled)
            new_tokens: list[int] = []
            for token in sampled:
                request.append_token(token)
                new_tokens.append(token)
                self.counters.generation_tokens += 1
                status = self._grammar_stop(request, token) or self._check_stop(request, token)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            first = request.first_token_time is None
            if first:
                # vLLM's prompt_tokens: counted at a request's first token, so a request
                # aborted or failed before it (a disconnect in the queue) adds nothing.
                request.first_token_time = now
                self.counters.prompt_tokens += request.num_prompt_tokens
                iteration_tokens += request.num_prompt_tokens
            iteration_tokens += len(new_tokens)
            output = self._make_output(request, new_tokens, None if lp is None else [lp],
                                       with_timings=first)
            if first and request.sampling_params.prompt_logprobs is not None:
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
            outputs.append(output)
        if iteration_tokens:
            self.counters.count_iteration(iteration_tokens)
        outputs.extend(self.apply_finished_transfers(FinishedTransfers(
            sending=runner_output.finished_sending,
            recving=runner_output.finished_recving,
            failed_recving=runner_output.failed_recving,
        )))
        return outputs

    @staticmethod
    def _grammar_stop(request: Request, token: int) -> RequestStatus | None:
        """Advance a constrained request's grammar by ``token``: a complete grammar (its
        stop token accepted) ends the request as a stop."""
        grammar = request.grammar
        if grammar is None:
            return None
        if not grammar.accept(token):
            # The sampler masks every token the grammar refuses: this is a bug, not input.
            logger.error("Request %s sampled token %d outside its grammar; stopping it",
                         request.request_id, token)
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None

    @staticmethod
    def _add_prompt_logprobs(request: Request, chunk: PromptLogprobsChunk) -> None:
        """Append the positions after those held, until the first token sent them: a step
        scheduled before a preemption and one recomputing after it give the same positions
        again (the same values), which are skipped by position."""
        if request.first_token_time is not None:
            return
        wanted = len(request.prompt_logprobs) + 1
        if chunk.first_position <= wanted < chunk.first_position + len(chunk.entries):
            request.prompt_logprobs.extend(chunk.entries[wanted - chunk.first_position:])

    def _check_stop(self: Scheduler, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def apply_finished_transfers(self: Scheduler, finished: FinishedTransfers) -> list[EngineOutput]:
        """Free sent requests' blocks, queue landed loads to run, fail or recompute failed
        ones (after a step, or before a pass for loads landed early)."""
        outputs: list[EngineOutput] = []
        self.connector.update_finished(finished)
        if finished.sending or finished.recving or finished.failed_recving:
            self.transfer_updates += 1
        # Held for a send that finished, or (consumer) for a load still writing into the
        # blocks when its request ended: the load's end is reported like any other.
        for request_id in finished.sending | finished.recving | finished.failed_recving:
            request = self.held.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
                self.requests.pop(request_id, None)
        for request_id in finished.recving:
            request = self.parked.pop(request_id, None)
            num_loaded = self._num_tokens_after_load.pop(request_id, None)
            if request is None or num_loaded is None:
                continue
            request.num_computed_tokens = num_loaded
            request.remote_kv_ready_time = time.monotonic()
            self.kv.cache_blocks(request, num_loaded)
            request.status = RequestStatus.WAITING
            self.landed.append(request)
        for request_id in finished.failed_recving:
            request = self.parked.pop(request_id, None)
            self._num_tokens_after_load.pop(request_id, None)
            if request is None:
                continue
            if self.load_failure_policy == "fail":
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._make_output(
                    request, [], error=f"KV transfer for {request_id} failed"))
                continue
            logger.warning("KV load for %s failed; recomputing the prompt locally", request_id)
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.kv_transfer_params = without_remote_prefill(request.kv_transfer_params)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        return outputs

    def _finish(self: Scheduler, request: Request, status: RequestStatus) -> None:
        """Mark finished and release (or hold, for a pending send) the request's blocks."""
        if request.grammar is not None:
            self.num_constrained -= 1
        request.status = status
        self._forget.add(request.request_id)
        block_ids = self.kv.get_block_ids(request.request_id)
        hold, request.kv_transfer_result = self.connector.request_finished(request, block_ids)
        if hold:
            self.held[request.request_id] = request
            return
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def _make_output(self: Scheduler, request: Request, new_tokens: list[int],
                     logprobs: list[TokenLogprob] | None = None,
                     error: str | None = None, with_timings: bool = False) -> EngineOutput:
        """The output of ``request``; its timings ride on the final output and, with
        ``with_timings``, on the first token's (the API may end the request itself on a stop
        string, and then has only those stamps)."""
        finished = request.is_finished
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            new_logprobs=logprobs,
            kv_transfer_params=request.kv_transfer_result if finished else None,
            error=error,
            timings=RequestTimings(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=time.monotonic() if finished else None,
                compute_start_time=request.compute_start_time,
                remote_kv_ready_time=request.remote_kv_ready_time,
            ) if finished or with_timings else None,
        )


def without_remote_prefill(params: KVTransferParams | None) -> KVTransferParams | None:
    """A consumer request that must recompute locally no longer waits for remote KV."""
    if params is None or not params.do_remote_prefill:
        return params
    return dataclasses.replace(params, do_remote_prefill=False)
