"""Front-end per-request state: engine outputs in, text deltas (and logprobs) out.

The engine core only produces token ids. The front end (API process or offline ``LLM``)
owns detokenization and stop strings; when a stop string matches, the request is finished
here and ``RequestDelta.needs_engine_abort`` tells the caller to abort it in the engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_core.detokenizer import IncrementalDetokenizer
from engine_core.kv_transfer_params import KVTransferResult
from engine_core.messages import EngineOutput, RequestTimings, TokenLogprob
from engine_core.sampling_params import SamplingParams


@dataclass
class TopLogprob:
    """One candidate token at a position."""

    token_id: int
    token: str
    logprob: float


@dataclass
class LogprobEntry:
    """The sampled token at one position, its logprob and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]


@dataclass
class RequestDelta:
    """What one engine output adds to a request, ready for a response chunk."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: KVTransferResult | None = None
    error: str | None = None
    # A stop string ended the request here: the engine still runs it until aborted.
    needs_engine_abort: bool = False
    # On the final delta only: the engine's, or where a stop string ended the request here,
    # the engine's last stamps (from its first token's output) ending now.
    timings: RequestTimings | None = None
    # With the first token of a request that asked for them (the engine's, positions 1..).
    prompt_logprobs: list[TokenLogprob] | None = None


class TokenTextCache:
    """Decoded text of single token ids, for logprob entries."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = cached
        return cached


@dataclass
class RequestState:
    """Detokenizer and counters of one in-flight request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_texts: TokenTextCache
    output_token_ids: list[int] = field(default_factory=list)
    # The released text in pieces: appending to one growing string copies it all each token,
    # a cost that grows with the output (nothing on the serving path reads the whole text).
    text_pieces: list[str] = field(default_factory=list)
    finished: bool = False
    engine_timings: RequestTimings | None = None  # the latest the engine sent
    # The stop string that handed-over tokens completed (``assume_delivered``): the request
    # ended there; its engine request only settles the prompt's KV.
    handed_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All text released so far."""
        return "".join(self.text_pieces)

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: Sequence[int],
               sampling_params: SamplingParams, tokenizer: Any,
               token_texts: TokenTextCache | None = None) -> RequestState:
        """State for a new request whose prompt is already tokenized."""
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids,
            skip_special_tokens=sampling_params.skip_special_tokens,
            stop=sampling_params.stop,
            include_stop_str_in_output=sampling_params.include_stop_str_in_output,
            min_tokens=sampling_params.min_tokens)
        return cls(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                   sampling_params=sampling_params, detokenizer=detokenizer,
                   token_texts=token_texts or TokenTextCache(tokenizer))

    def assume_delivered(self, token_ids: Sequence[int]) -> None:
        """Fold in output tokens whose text the client already received (a prefill worker's
        first token, streamed by the proxy): they count as output, their text is not sent
        again, and later deltas are exactly what an uninterrupted stream would carry."""
        update = self.detokenizer.update(list(token_ids), finished=False)
        self.output_token_ids.extend(token_ids)
        self.text_pieces.append(update.text)
        self.handed_stop = update.stop_str

    def _logprob_entries(self, logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
        entries = []
        for lp in logprobs:
            top = [TopLogprob(tid, self.token_texts.text(tid), value)
                   for tid, value in zip(lp.top_token_ids, lp.top_logprobs, strict=False)]
            entries.append(LogprobEntry(lp.token_id, self.token_texts.text(lp.token_id),
                                        lp.logprob, top))
        return entries

    def process(self, output: EngineOutput) -> RequestDelta | None:
        """Fold one engine output in; None when the request already finished here."""
        if self.finished:
            return None
        engine_finished = output.finish_reason is not None
        if self.handed_stop is not None:
            return self._handed_stop_delta(output)
        text_ids = output.new_token_ids
        stopped_by_token = output.finish_reason == "stop"
        if (stopped_by_token and text_ids
                and not self.sampling_params.include_stop_str_in_output):
            # As vLLM: the token that stopped the request (EOS or a stop_token_ids entry; the
            # engine stops on tokens only) counts as output, its text does not.
            text_ids = text_ids[:-1]
        # A stop with no new token: the stopping token was handed over (``assume_delivered``)
        # and the worker that sampled it already applied the rule above to its text, so
        # nothing of it is released here (flushing would send a partial character of it).
        flush = engine_finished and not (stopped_by_token and not output.new_token_ids)
        update = self.detokenizer.update(text_ids, finished=flush)
        self.output_token_ids.extend(output.new_token_ids)
        self.text_pieces.append(update.text)
        stopped_here = update.stop_str is not None
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if stopped_here:
            finish_reason, stop_reason = "stop", update.stop_str
        self.finished = engine_finished or stopped_here
        if output.timings is not None:
            self.engine_timings = output.timings
        timings = None
        if engine_finished:
            timings = output.timings
        elif stopped_here and self.engine_timings is not None:
            # Ended here, not in the engine: its stamps so far, finished now (the engine and
            # API processes share the host's monotonic clock).
            timings = dataclasses.replace(self.engine_timings, finished_time=time.monotonic())
        logprobs = None
        if self.sampling_params.logprobs is not None:
            logprobs = self._logprob_entries(output.new_logprobs or [])
        return RequestDelta(
            request_id=self.request_id, text=update.text,
            token_ids=list(output.new_token_ids), logprobs=logprobs,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            num_output_tokens=len(self.output_token_ids),
            finished=self.finished, finish_reason=finish_reason, stop_reason=stop_reason,
            kv_transfer_params=output.kv_transfer_params, error=output.error,
            needs_engine_abort=stopped_here and not engine_finished,
            timings=timings, prompt_logprobs=output.prompt_logprobs)


    def _handed_stop_delta(self, output: EngineOutput) -> RequestDelta:
        """The finish of a request whose handed-over tokens completed a stop string: what
        a direct stream's last chunk carries after that text (sent by the worker that
        sampled them); the engine's own output adds nothing."""
        self.finished = True
        engine_finished = output.finish_reason is not None
        return RequestDelta(
            request_id=self.request_id, text="", token_ids=[],
            logprobs=[] if self.sampling_params.logprobs is not None else None,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            num_output_tokens=len(self.output_token_ids), finished=True,
            finish_reason="stop", stop_reason=self.handed_stop,
            kv_transfer_params=output.kv_transfer_params, error=output.error,
            needs_engine_abort=not engine_finished,
            timings=output.timings if engine_finished else None)


class OutputProcessor:
    """Request states by id, for callers that multiplex many requests (offline ``LLM``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_texts = TokenTextCache(tokenizer)
        self._states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams) -> RequestState:
        state = RequestState.create(request_id, prompt_token_ids, sampling_params,
                                    self._tokenizer, self._token_texts)
        self._states[request_id] = state
        return state

    def process_outputs(self, outputs: Sequence[EngineOutput]) -> tuple[list[RequestDelta], list[str]]:
        """Deltas of known requests, and the ids to abort in the engine (stop strings)."""
        deltas, to_abort = [], []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue
            delta = state.process(output)
            if delta is None:
                continue
            deltas.append(delta)
            if delta.needs_engine_abort:
                to_abort.append(output.request_id)
            if delta.finished:
                del self._states[output.request_id]
        return deltas, to_abort

    def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._states)
