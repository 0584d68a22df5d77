"""A prefill worker's side of the first-token handoff: the answer that carries its first token
(and the stream events that show it to the client) to the proxy, and the text a continuing
stream already sent for handed-over tokens.

A mixin of ``OpenAIServing`` (``serving.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine_core.messages import EngineOutput
from engine_core.output_processor import RequestDelta, RequestState
from engine_core.server import protocol, streaming
from engine_core.server.jobs import Job
from engine_core.server.responses import ChoiceResult, add_kv_transfer_params, add_server_timings

if TYPE_CHECKING:
    from engine_core.server.serving import OpenAIServing


class FirstTokenAnswers:
    """``OpenAIServing``'s answers for the first-token handoff."""

    def _handed_text(self: OpenAIServing, job: Job) -> str:
        """The text a stream already sent for a job's handed-over tokens."""
        state = RequestState.create(job.request_id, job.prompt_token_ids, job.params,
                                    self.tokenizer.tokenizer, self._token_texts)
        state.assume_delivered(job.generated_token_ids)
        return "".join(state.text_pieces)

    def _first_delta(self: OpenAIServing, job: Job, choice: ChoiceResult) -> RequestDelta | None:
        """What a stream would have sent for this answer's first token, had the request
        gone on: its text with stop-string hold-back applied, not flushed as a finished
        answer's is. None when nothing was sampled.

        A token that stopped the request (EOS, a ``stop_token_ids`` entry) is processed as
        the stop it is, so its text is dropped as a direct stream drops it (kept with
        ``include_stop_str_in_output``); its finish is not sent: the decode worker,
        continuing after the token, finds that it ends the request and sends the finish
        (reason and stop reason) as a direct stream's last chunk carries it. A stop string
        the token completes is handled alike: the text before it (with it, under
        ``include_stop_str_in_output``) goes now, the finish from the decode worker."""
        if not choice.token_ids:
            return None
        state = RequestState.create(job.request_id, job.prompt_token_ids, job.params,
                                    self.tokenizer.tokenizer, self._token_texts)
        # Stopped by the token itself; a stop string is found again by ``process``.
        stopped = choice.finish_reason == "stop" and not isinstance(choice.stop_reason, str)
        delta = state.process(EngineOutput(
            request_id=job.request_id, new_token_ids=choice.token_ids[:1],
            num_prompt_tokens=choice.num_prompt_tokens, num_cached_tokens=choice.num_cached_tokens,
            finish_reason="stop" if stopped else None,
            stop_reason=choice.stop_reason if stopped else None, new_logprobs=[]))
        if delta is None:
            return None
        delta = dataclasses.replace(delta, finished=False, finish_reason=None, stop_reason=None,
                                    needs_engine_abort=False, timings=None)
        if job.params.logprobs is not None:
            delta.logprobs = choice.logprobs[:1]
        return delta

    async def _json_answer(self: OpenAIServing, request: web.Request, response: dict[str, Any],
                           choices: list[ChoiceResult], jobs: list[Job],
                           handoff: protocol.Handoff, headers: dict[str, str],
                           first_chunks: Callable[[list[RequestDelta]], list[dict[str, Any]]]
                           ) -> web.StreamResponse:
        """A non-streamed answer with its extras: the engine's transfer params, server
        timings and, for a prefill worker asked for them, ``pdserve_first_token``: each
        choice's token the decode worker continues after (``token_ids[i]`` for choice i)
        and the stream events (``first_chunks`` of their deltas) that carry them to the
        client, which the proxy sends as they are. Written
        under the write bound as streams are: aiohttp's own final write waits without
        limit on a client that does not read (n samples with logprobs make MBs)."""
        add_kv_transfer_params(response, choices)
        add_server_timings(response, choices)
        if handoff.first_events:
            firsts = [self._first_delta(job, choice) for job, choice in zip(jobs, choices,
                                                                            strict=True)]
            if all(first is not None for first in firsts):
                deltas = [first for first in firsts if first is not None]
                response["pdserve_first_token"] = {
                    "token_ids": [delta.token_ids for delta in deltas],
                    "events": first_chunks(deltas)}
        body = json.dumps(response).encode()
        out = web.StreamResponse(headers={"Content-Type": "application/json", **headers})
        out.content_length = len(body)
        await out.prepare(request)
        stream = streaming.SSEStream(request, out, self.write_bound)
        with contextlib.suppress(streaming.ClientStalledError):  # aborted, counted, logged
            await stream.write(body)
            await stream.write_eof()
        return out
