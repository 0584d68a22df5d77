"""/v1/chat/completions: a chat request through the chat template to its engine jobs, answered
whole or streamed, with tool calls parsed from the text when the request offers tools.

A mixin of ``OpenAIServing`` (``serving.py``), which runs the jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine_core.output_processor import RequestDelta
from engine_core.server import protocol, streaming
from engine_core.server.client_request import check_client_connected
from engine_core.server.http_errors import REQUEST_ID_KEY
from engine_core.server.jobs import engine_request_id, prefill_only
from engine_core.server.prompt_logprobs import for_decode_leg, prompt_logprobs_field
from engine_core.server.responses import (
    ChoiceResult,
    add_kv_transfer_params,
    add_server_timings,
    chat_chunk,
    chat_logprobs,
    chat_role_chunk,
    chunk_sender,
    stream_ending,
    usage,
    worth_a_chunk,
)
from engine_core.server.structured_fields import needs_grammar_engine
from engine_core.server.tool_stream import ChatTools

if TYPE_CHECKING:
    from engine_core.server.serving import OpenAIServing


class ChatCompletions:
    """``OpenAIServing``'s chat endpoint."""

    async def chat(self: OpenAIServing, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if needs_grammar_engine(body):
            await self.grammar.ready()
        parsed = protocol.parse_chat_request(body, self.generation)
        model = self.check_model(parsed.model)
        request_id = request[REQUEST_ID_KEY]
        params = parsed.sampling_params
        if parsed.tools is not None:
            parsed.tools.check_auto(self.tool_calls)
            if parsed.tools.keeps_special_tokens(self.tool_calls):
                params = dataclasses.replace(params, skip_special_tokens=False)
        prompt = await self.tokenizer.call(self.tokenizer.encode_chat, parsed.messages,
                                           parsed.add_generation_prompt,
                                           parsed.truncate_prompt_tokens, parsed.template)
        jobs = self._jobs(engine_request_id(request_id), [prompt], params,
                          parsed.kv_transfer_params, parsed.handoff)
        tools = (None if parsed.tools is None or parsed.tools.choice == "none" else
                 ChatTools(parsed.tools, self.tool_calls, request_id, prompt, len(jobs)))
        stream = parsed.stream and not prefill_only(parsed.kv_transfer_params, parsed.handoff)
        check_client_connected(request)
        events = self._run_jobs(jobs)
        head = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": model}
        chunk_head = {**head, "object": "chat.completion.chunk"}
        headers = {"X-Request-Id": request_id}
        want_logprobs = parsed.sampling_params.logprobs is not None
        choices = [ChoiceResult() for _ in jobs]
        async with contextlib.aclosing(events):
            if not stream:
                async for index, delta in events:
                    choices[index].add(delta)
                response = {**head, "object": "chat.completion", "choices": [{
                    "index": i, "message": (tools.message(i, c.text) if tools else
                                            {"role": "assistant", "content": c.text}),
                    "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                    "finish_reason": (tools.finish_reason(i, c.finish_reason) if tools
                                      else c.finish_reason),
                    "stop_reason": c.stop_reason}
                    for i, c in enumerate(choices)], "usage": usage(choices, jobs),
                    **prompt_logprobs_field(choices[0].prompt_logprobs,
                                            self._token_texts.text)}
                if prefill_only(parsed.kv_transfer_params, parsed.handoff):
                    response.update(for_decode_leg(choices, jobs))

                def first_chunks(deltas: list[RequestDelta]) -> list[dict[str, Any]]:
                    roles = [chat_role_chunk(chunk_head, i) for i in range(len(deltas))]
                    if tools is not None:
                        return [*roles, *(chunk for i, delta in enumerate(deltas)
                                          for chunk in tools.chunks(chunk_head, i, delta,
                                                                    want_logprobs))]
                    return [*roles, *(chat_chunk(chunk_head, i, delta, want_logprobs)
                                      for i, delta in enumerate(deltas) if worth_a_chunk(delta))]

                return await self._json_answer(request, response, choices, jobs,
                                               parsed.handoff, headers, first_chunks)
            first = await anext(events, None)
            sse = await streaming.start_sse(request, self.write_bound, headers)
            send = chunk_sender(sse, parsed.continuous_usage, choices, jobs,
                                parsed.handoff.stream_token_ids)
            if tools is not None:  # the client has the text of handed-over tokens
                for index, job in enumerate(jobs):
                    if job.generated_token_ids:
                        tools.prime(index, self._handed_text(job))
            async with stream_ending(sse, request_id):
                if not parsed.handoff.continues:  # else the client has the role chunk
                    for index in range(len(jobs)):
                        await send(chat_role_chunk(chunk_head, index))
                item = first
                while item is not None:
                    index, delta = item
                    choice = choices[index]
                    choice.add(delta)
                    chunks = (tools.chunks(chunk_head, index, delta, want_logprobs) if tools
                              else [chat_chunk(chunk_head, index, delta, want_logprobs)]
                              if worth_a_chunk(delta) else [])
                    if chunks:
                        if delta.finished:
                            add_kv_transfer_params(chunks[-1], [choice])
                            add_server_timings(chunks[-1], [choice])
                        await send(chunks, index)
                    item = await anext(events, None)
                if parsed.include_usage:
                    await streaming.send_event(sse, {**chunk_head, "choices": [],
                                                     "usage": usage(choices, jobs)})
            return sse.response
