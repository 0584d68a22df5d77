"""The /v1/completions and /v1/chat/completions handlers over an ``AsyncEngineClient``.

Each prompt becomes one engine request, pumped by its own task into a shared queue, so a
batch of prompts streams interleaved. Leaving a handler early (client gone, error, a client
that stopped reading sent away after ``--write-timeout``) cancels the pumps, and cancelling
a pump aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine_core.engine_client import AsyncEngineClient
from engine_core.errors import ModelNotFoundError
from engine_core.grammar.prefetch import GrammarEngineImport
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.models.generation_config import GenerationDefaults
from engine_core.output_processor import RequestDelta, RequestState, TokenTextCache
from engine_core.request_limits import check_generated_ids
from engine_core.sampling_params import SamplingParams, sample_seed
from engine_core.server import protocol, streaming
from engine_core.server.chat_serving import ChatCompletions
from engine_core.server.client_request import check_client_connected
from engine_core.server.first_token_answers import FirstTokenAnswers
from engine_core.server.http_errors import REQUEST_ID_KEY
from engine_core.server.jobs import (
    Job,
    engine_request_id,
    moves_kv,
    one_sample_params,
    prefill_only,
    prompt_transfer_params,
    samples_run,
    without_transfer,
)
from engine_core.server.metrics import ServerMetrics
from engine_core.server.prompt_logprobs import (
    echo_chunk,
    echo_logprobs,
    for_decode_leg,
    given_prompt_logprobs,
    prompt_chars,
    prompt_logprobs_field,
    without_given,
)
from engine_core.server.responses import (
    ChoiceResult,
    add_kv_transfer_params,
    add_server_timings,
    chunk_sender,
    completion_chunk,
    completion_logprobs,
    stream_ending,
    usage,
    worth_a_chunk,
)
from engine_core.server.structured_fields import needs_grammar_engine
from engine_core.server.timings import breakdown
from engine_core.server.tokenization import TokenizerService
from engine_core.server.tools import ToolCallOptions

logger = logging.getLogger("pdserve.server")

class OpenAIServing(ChatCompletions, FirstTokenAnswers):
    """Turns validated OpenAI requests into engine requests and responses."""

    def __init__(self, client: AsyncEngineClient, tokenizer: TokenizerService,
                 model_names: list[str], metrics: ServerMetrics,
                 write_timeout_s: float = 60.0,
                 generation: GenerationDefaults = protocol.NO_DEFAULTS,
                 tool_calls: ToolCallOptions | None = None,
                 grammar: GrammarEngineImport | None = None) -> None:
        self.client = client
        self.grammar = grammar or GrammarEngineImport()  # awaited by constrained requests
        self.tool_calls = tool_calls or ToolCallOptions()  # --tool-call-parser and its switch
        self.generation = generation  # the generation config's request defaults
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.metrics = metrics
        self.write_bound = streaming.WriteBound(write_timeout_s, self._on_write_stall)
        self._token_texts = TokenTextCache(tokenizer.tokenizer)

    def _on_write_stall(self, request: web.Request) -> None:
        """A streaming client took no bytes for the write bound: count and log it (its
        connection is aborted, which aborts its engine requests)."""
        self.metrics.observe_write_timeout()
        logger.warning("request %s: the client took no bytes for %g s (not reading); its "
                       "connection is closed and its engine requests aborted",
                       request.get(REQUEST_ID_KEY, "-"), self.write_bound.timeout_s)

    def check_model(self, model: str | None) -> str:
        """The served name a request addresses (the default when it names none)."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        return model

    # ---- generation ---------------------------------------------------------------------

    async def _generate(self, job: Job, arrival: float) -> AsyncIterator[RequestDelta]:
        """Deltas of one engine request, with metrics; stops the engine on a stop string.

        A request continuing after the job's ``generated_token_ids`` (the client got their
        text from the prefill worker, which observed the time to first token) streams what
        follows; where they completed a stop string it only sends the finish, its engine
        request limited to them (it settles the prompt's KV and samples nothing).
        ``arrival``: when the HTTP request arrived, shared by all its samples (a sample
        that waits for sample 0's first token still counts that wait, as vLLM's children
        share their parent's arrival)."""
        params, generated = job.params, job.generated_token_ids
        state = RequestState.create(job.request_id, job.prompt_token_ids, params,
                                    self.tokenizer.tokenizer, self._token_texts)
        state.assume_delivered(generated)
        engine_params = (params if state.handed_stop is None
                         else dataclasses.replace(params, max_tokens=len(generated)))
        given = job.prompt_logprobs
        first_token_time: float | None = None
        last_token_time: float | None = None
        finish_reason, num_output = None, 0
        try:
            outputs = self.client.generate(job.request_id, job.prompt_token_ids, engine_params,
                                           job.kv_transfer_params, generated)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    delta = state.process(output)
                    if delta is None:
                        continue
                    if given is not None:  # the prefill worker's, with the first delta
                        delta.prompt_logprobs, given = given, None
                    now = time.monotonic()
                    if delta.token_ids:
                        if last_token_time is not None:
                            self.metrics.observe_inter_token(now - last_token_time)
                        else:
                            first_token_time = now
                            if not generated:
                                self.metrics.observe_first_token(now - arrival)
                        last_token_time = now
                    num_output = delta.num_output_tokens
                    if delta.finished:
                        finish_reason = delta.finish_reason
                    if delta.timings is not None:
                        self.metrics.observe_breakdown(breakdown(
                            delta.timings, time.monotonic(), time.time()))
                    yield delta
                    if delta.finished:
                        # A stop string ended it here: closing the stream aborts it in the engine.
                        break
        finally:
            # A request left before its end (client gone, a sibling sample failed, shutdown)
            # has no finish reason and, as in vLLM, no finished-request stats: its engine
            # stream was closed, which aborted it there.
            decode_s = (None if first_token_time is None or last_token_time is None
                        else last_token_time - first_token_time)
            max_tokens = (params.max_tokens if params.max_tokens is not None
                          else self.tokenizer.max_model_len - len(job.prompt_token_ids))
            self.metrics.observe_finished(time.monotonic() - arrival, finish_reason,
                                          len(job.prompt_token_ids),
                                          max(0, num_output - len(generated)), max_tokens,
                                          decode_s)

    async def _run_jobs(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, delta) of all jobs, interleaved as they arrive."""
        queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()
        started = [asyncio.Event() for _ in jobs]  # set at a job's first delta (or its end)
        arrival = time.monotonic()

        async def pump(index: int, job: Job) -> None:
            try:
                if job.after is not None:
                    await started[job.after].wait()
                async for delta in self._generate(job, arrival):
                    started[index].set()
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                started[index].set()

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        # Per prompt: samples not finished yet, and the most tokens one of them generated.
        group_size = collections.Counter(job.prompt_index for job in jobs)  # the request's n
        unfinished = group_size.copy()
        most_tokens = dict.fromkeys(unfinished, 0)
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    if item.finished and item.finish_reason in ("stop", "length"):
                        prompt = jobs[index].prompt_index
                        # Tokens another worker generated (the handoff) are not this
                        # worker's, as in request_generation_tokens.
                        generated_here = (item.num_output_tokens
                                          - len(jobs[index].generated_token_ids))
                        most_tokens[prompt] = max(most_tokens[prompt], generated_here)
                        unfinished[prompt] -= 1
                        if not unfinished[prompt]:
                            self.metrics.observe_group(group_size[prompt], most_tokens[prompt])
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _jobs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
              kv_transfer_params: KVTransferParams | None, handoff: protocol.Handoff
              ) -> list[Job]:
        """One engine request per (prompt, sample), in OpenAI's choice order.

        Sample ``s`` of a seeded request draws with ``seed + s``. Each prompt of a batch
        has its own transfer id (``T-p<i>``, derived the same way on P and D); only a
        prompt's sample 0 moves KV between workers: the others wait for sample 0's first
        token and then find the prompt in the prefix cache. A prefill-only request
        (``prefill_only``) is checked with the client's limits, so one D would refuse is
        refused here, before anything is computed; then it runs one token, of one sample
        (a prefill leg) or of each (a handoff's first tokens). Sample ``s`` of a handoff's
        continuation goes on after the handoff's ``generated_token_ids[s]``.
        """
        for ids in prompts:
            self.tokenizer.check_length(len(ids), params.max_tokens)
        # The detokenizer decodes handed-over ids before the engine checks them (the
        # tokenizer fails, a 500, on ids past 32 bits): the engine's rule, checked first here.
        for ids in handoff.generated_token_ids:
            check_generated_ids(ids, self.tokenizer.vocab_size)
        given = given_prompt_logprobs(kv_transfer_params, prompts, params)
        kv_transfer_params = without_given(kv_transfer_params)
        engine_params = one_sample_params(params, prefill_only(kv_transfer_params, handoff))
        if given is not None:  # the prefill worker computed them: none here
            engine_params = dataclasses.replace(engine_params, prompt_logprobs=None)
        num_samples = samples_run(params, kv_transfer_params, handoff)
        single = len(prompts) == 1 and num_samples == 1
        jobs: list[Job] = []
        for prompt_index, ids in enumerate(prompts):
            transfer = prompt_transfer_params(kv_transfer_params, prompt_index, len(prompts))
            first = len(jobs)
            for sample in range(num_samples):
                index = len(jobs)
                sample_params = engine_params if params.seed is None or sample == 0 else \
                    dataclasses.replace(engine_params, seed=sample_seed(params.seed, sample))
                remote = transfer if sample == 0 else without_transfer(transfer)
                waits = sample > 0 and moves_kv(transfer)
                jobs.append(Job(request_id if single else f"{request_id}-{index}", ids,
                                 sample_params, remote, prompt_index, sample,
                                 first if waits else None,
                                 list(handoff.generated_token_ids[sample])
                                 if handoff.generated_token_ids else [],
                                 None if given is None else given[prompt_index]))
        return jobs

    # ---- /v1/completions ----------------------------------------------------------------

    async def completions(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if needs_grammar_engine(body):
            await self.grammar.ready()
        parsed = protocol.parse_completion_request(body, self.generation)
        model = self.check_model(parsed.model)
        request_id = request[REQUEST_ID_KEY]
        tokenizer = self.tokenizer
        prompts = [await tokenizer.call(tokenizer.encode_prompt, p, parsed.truncate_prompt_tokens,
                                        parsed.add_special_tokens)
                   for p in parsed.prompts]
        # echo: each choice starts with its prompt, as given (token ids or a truncated
        # prompt: what was used, decoded).
        echoes = [(p if isinstance(p, str) and parsed.truncate_prompt_tokens is None
                   else await tokenizer.call(tokenizer.decode, ids)) if parsed.echo else ""
                  for p, ids in zip(parsed.prompts, prompts, strict=True)]
        jobs = self._jobs(engine_request_id(request_id), prompts, parsed.sampling_params,
                          parsed.kv_transfer_params, parsed.handoff)
        stream = parsed.stream and not prefill_only(parsed.kv_transfer_params, parsed.handoff)
        check_client_connected(request)
        events = self._run_jobs(jobs)
        head = {"id": f"cmpl-{request_id}", "object": "text_completion",
                "created": int(time.time()), "model": model}
        headers = {"X-Request-Id": request_id}
        want_logprobs = parsed.sampling_params.logprobs is not None
        choices = [ChoiceResult() for _ in jobs]
        async with contextlib.aclosing(events):
            if not stream:
                async for index, delta in events:
                    choices[index].add(delta)
                response = {**head, "choices": [
                    {"index": i, "text": echoes[jobs[i].prompt_index] + c.text,
                     "logprobs": (self._completion_logprobs(c, jobs[i], parsed.echo)
                                  if want_logprobs else None),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     **prompt_logprobs_field(c.prompt_logprobs, self._token_texts.text)}
                    for i, c in enumerate(choices)], "usage": usage(choices, jobs)}
                if prefill_only(parsed.kv_transfer_params, parsed.handoff):
                    response.update(for_decode_leg(choices, jobs))

                def first_chunks(deltas: list[RequestDelta]) -> list[dict[str, Any]]:
                    return [completion_chunk(head, i, delta, 0, want_logprobs)
                            for i, delta in enumerate(deltas) if worth_a_chunk(delta)]

                return await self._json_answer(request, response, choices, jobs,
                                               parsed.handoff, headers, first_chunks)
            # Wait for the first delta before sending headers: early errors keep their status.
            first = await anext(events, None)
            sse = await streaming.start_sse(request, self.write_bound, headers)
            send = chunk_sender(sse, parsed.continuous_usage, choices, jobs,
                                parsed.handoff.stream_token_ids)
            if want_logprobs:  # text offsets go on after handed-over tokens' characters
                for choice, job in zip(choices, jobs, strict=True):
                    choice.logprob_chars = sum(len(self._token_texts.text(t))
                                               for t in job.generated_token_ids)
            # echo: a choice's prompt (with its logprobs, which come with its first delta)
            # goes out just before that delta.
            echoed = [not parsed.echo] * len(jobs)
            async with stream_ending(sse, request_id):
                pending = [first] if first is not None else []
                while True:
                    for index, delta in pending:
                        choice = choices[index]
                        if not echoed[index]:
                            echoed[index] = True
                            await send(echo_chunk(head, index, jobs[index].prompt_token_ids,
                                                  echoes[jobs[index].prompt_index],
                                                  delta.prompt_logprobs if want_logprobs
                                                  else None, self._token_texts.text))
                            if want_logprobs:
                                choice.logprob_chars = prompt_chars(
                                    jobs[index].prompt_token_ids, self._token_texts.text)
                        offset = choice.logprob_chars
                        choice.add(delta)
                        if not worth_a_chunk(delta):
                            continue
                        chunk = completion_chunk(head, index, delta, offset, want_logprobs)
                        if delta.finished:
                            add_kv_transfer_params(chunk, [choice])
                            add_server_timings(chunk, [choice])
                        await send(chunk, index)
                    item = await anext(events, None)
                    if item is None:
                        break
                    pending = [item]
                if parsed.include_usage:
                    await streaming.send_event(sse, {**head, "choices": [],
                                                     "usage": usage(choices, jobs)})
            return sse.response

    def _completion_logprobs(self, choice: ChoiceResult, job: Job, echo: bool
                             ) -> dict[str, Any]:
        """A choice's legacy logprobs: the echoed prompt's first when it echoes."""
        if not echo or choice.prompt_logprobs is None:
            return completion_logprobs(choice.logprobs, 0)
        text, prompt = self._token_texts.text, job.prompt_token_ids
        return echo_logprobs(prompt, choice.prompt_logprobs, text,
                             completion_logprobs(choice.logprobs, prompt_chars(prompt, text)))
