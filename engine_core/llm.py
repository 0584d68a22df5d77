"""Offline batch generation over an in-process EngineCore: ``LLM(...).generate(...)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.messages import AddRequest
from engine_core.models.generation_config import load_generation_defaults
from engine_core.output_processor import LogprobEntry, OutputProcessor
from engine_core.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (monotonic clock)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[LogprobEntry] | None = None
    metrics: RequestMetrics | None = None


class LLM:
    """Synchronous engine for offline use and for tests; the same engine workers run."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        from transformers import AutoTokenizer

        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.tokenizer_path)
        self.generation = load_generation_defaults(self.config.model,
                                                   self.tokenizer.eos_token_id)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the params of ``generate`` calls that give none, with the generation
        config's sampling defaults (``generation_config``, ``override_generation_config``)."""
        return self.generation.default_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion together; results in input order. Each request
        also stops at the generation config's eos ids unless it sets ``ignore_eos``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, given in zip(prompts, sampling_params):
            params = self.generation.stopping(given)
            request_id = f"offline-{next(self._ids)}"
            token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                         else list(prompt))
            now = time.monotonic()
            self.engine.add_request(AddRequest(request_id, token_ids, params.to_dict(), now))
            processor.add_request(request_id, token_ids, params)
            results[request_id] = RequestOutput(
                request_id, prompt if isinstance(prompt, str) else None, token_ids,
                metrics=RequestMetrics(arrival_time=now),
                logprobs=[] if params.logprobs is not None else None)
            order.append(request_id)
        while processor.has_unfinished():
            deltas, to_abort = processor.process_outputs(self.engine.step())
            if to_abort:
                self.engine.abort_requests(to_abort)
            now = time.monotonic()
            for delta in deltas:
                result = results[delta.request_id]
                result.token_ids.extend(delta.token_ids)
                result.text += delta.text
                result.num_cached_tokens = delta.num_cached_tokens
                if delta.logprobs is not None and result.logprobs is not None:
                    result.logprobs.extend(delta.logprobs)
                if result.metrics.first_token_time is None and delta.token_ids:
                    result.metrics.first_token_time = now
                if delta.finished:
                    result.finish_reason = delta.finish_reason
                    result.stop_reason = delta.stop_reason
                    result.metrics.finished_time = now
        # Aborted-by-stop-string requests leave a final engine output behind; drain it.
        while self.engine.has_runnable():
            self.engine.step()
        return [results[r] for r in order]

    def sleep(self, level: int = 1) -> dict[str, float]:
        """Free the weights' and KV cache's device memory (needs ``enable_sleep_mode=True``);
        returns the seconds of each phase."""
        return self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, float]:
        """Back from ``sleep``: weights, an empty KV cache and the graphs restored (only
        the ``tags`` given: ``weights``, ``kv_cache``); returns the seconds of each phase."""
        return self.engine.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine: its connector and, with tensor parallelism, its other ranks."""
        self.engine.shutdown()
