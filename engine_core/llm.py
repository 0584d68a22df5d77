"""Offline batch generation over an in-process EngineCore, in vLLM's shape:
``LLM(model).generate(prompts)`` and ``LLM(model).chat(messages)``."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine_core.arg_utils import engine_environment
from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.errors import InvalidRequestError
from engine_core.hf_tokenizer import load_hf_tokenizer
from engine_core.messages import AddRequest
from engine_core.models.generation_config import load_generation_defaults
from engine_core.output_processor import OutputProcessor, TokenTextCache
from engine_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine_core.prompt_logprobs import Logprob, to_prompt_logprobs
from engine_core.sampling_params import SamplingParams, sample_seed

# vLLM's prompt forms: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | list[int] | Mapping[str, Any]
Message = Mapping[str, Any]

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


class LLM:
    """Synchronous engine for offline use and for tests; the same engine workers run.

    ``model`` is an HF checkpoint directory or a ``.gguf`` file (converted once and cached);
    keyword arguments are the engine flags' vLLM names (``max_num_seqs=...``).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        from engine_core.gguf import resolve_gguf_model

        self.config = resolve_gguf_model(EngineConfig.from_kwargs(
            str(model), **{**engine_environment(os.environ), **engine_args}))
        self.engine = EngineCore(self.config)
        self.tokenizer = load_hf_tokenizer(self.engine.tokenizer_path)
        self.generation = load_generation_defaults(self.config.model,
                                                   self.tokenizer.eos_token_id)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The HF tokenizer the engine's prompts are encoded with."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the params of ``generate`` calls that give none, with the generation
        config's sampling defaults (``generation_config``, ``override_generation_config``)."""
        return self.generation.default_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion together; results in input order. Each request
        also stops at the generation config's eos ids unless it sets ``ignore_eos``."""
        parsed = [self._parse_prompt(p) for p in _prompt_list(prompts)]
        return self._run(parsed, sampling_params)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``
        messages) or to a list of conversations, through the model's chat template."""
        conversations = ([messages] if messages and isinstance(messages[0], Mapping)
                         else list(messages))
        parsed = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation), chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            # The template writes the special tokens itself, as vLLM's chat does.
            parsed.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(parsed, sampling_params)

    def _parse_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt in any of vLLM's forms."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequestError("a dict prompt needs 'prompt' (text) or "
                                      "'prompt_token_ids'", "prompt")
        return None, [int(t) for t in prompt]

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None
             ) -> list[RequestOutput]:
        """Add every (text, token ids) prompt, step the engine until all finish. A prompt
        with ``n`` > 1 is ``n`` engine requests (seeds ``seed + i``, as the server fans out)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        processor = OutputProcessor(self.tokenizer)
        token_texts = TokenTextCache(self.tokenizer)
        results: list[RequestOutput] = []
        samples: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for (text, token_ids), given in zip(prompts, sampling_params):
            params = self.generation.stopping(given)
            request_id = f"offline-{next(self._ids)}"
            now = time.monotonic()
            result = RequestOutput(request_id, text, token_ids, [],
                                   metrics=RequestMetrics(arrival_time=now))
            results.append(result)
            for index in range(params.n):
                one = dataclasses.replace(params, n=1, seed=None if params.seed is None
                                          else sample_seed(params.seed, index))
                sample_id = request_id if params.n == 1 else f"{request_id}-{index}"
                self.engine.add_request(AddRequest(sample_id, token_ids, one.to_dict(), now))
                processor.add_request(sample_id, token_ids, one)
                completion = CompletionOutput(
                    index=index, logprobs=[] if params.logprobs is not None else None)
                result.outputs.append(completion)
                samples[sample_id] = (result, completion)
        while processor.has_unfinished():
            deltas, to_abort = processor.process_outputs(self.engine.step())
            if to_abort:
                self.engine.abort_requests(to_abort)
            now = time.monotonic()
            for delta in deltas:
                result, completion = samples[delta.request_id]
                completion.token_ids.extend(delta.token_ids)
                completion.text += delta.text
                result.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = to_prompt_logprobs(delta.prompt_logprobs,
                                                                token_texts.text)
                if delta.logprobs is not None and completion.logprobs is not None:
                    completion.logprobs.extend(delta.logprobs)
                if result.metrics.first_token_time is None and delta.token_ids:
                    result.metrics.first_token_time = now
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    result.finished = all(c.finish_reason is not None for c in result.outputs)
                    result.metrics.finished_time = now
        # Aborted-by-stop-string requests leave a final engine output behind; drain it.
        while self.engine.has_runnable():
            self.engine.step()
        return results

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

def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them as a list (a list of ints is one token-id prompt)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts
