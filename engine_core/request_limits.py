"""The limits a request is checked against, as pure functions: the engine checks what it is
asked to run, and the API front end checks the same rules earlier (a prefill worker sampling
the handoff's first token runs fewer tokens than the client's limit, and detokenizes handed
over ids before its engine sees them), so both say the same thing in the same words."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_core.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine_core.sampling_params import SamplingParams

# Choices (prompts x n) of one request: each is an engine request and a task in the server.
MAX_CHOICES = 1024


def check_generated_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Tokens handed over as already generated must be ids of the vocabulary."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise InvalidRequestError(f"generated token ids must be in [0, {vocab_size})",
                                  "kv_transfer_params")


def check_token_ids(prompt: Sequence[int], generated: Sequence[int], params: SamplingParams,
                    vocab_size: int) -> None:
    """Every token id an engine request names (its prompt, the tokens handed over, and its
    sampling params' logit_bias, allowed_token_ids and stop_token_ids) must be of the
    vocabulary: the sampler indexes its rows by them."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    check_generated_ids(generated, vocab_size)
    for name, label, ids in (("logit_bias", "logit_bias token ids", params.logit_bias),
                             ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids),
                             ("stop_token_ids", "stop_token_ids", params.stop_token_ids)):
        if ids and max(ids) >= vocab_size:
            raise InvalidRequestError(f"{label} must be in [0, {vocab_size})", name)


def check_context(num_tokens: int, max_tokens: int | None, max_model_len: int,
                  kv_capacity: int | None) -> None:
    """A prompt of ``num_tokens`` must leave room for output in the context and in the whole
    KV cache (``kv_capacity`` tokens; None: not known here), and ``max_tokens`` more must fit
    both. A request larger than the cache would preempt itself forever, and every request
    queued behind it would wait."""
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_tokens} tokens, leaving no room for output.", "prompt")
    if kv_capacity is not None and num_tokens >= kv_capacity:
        raise InvalidRequestError(
            f"The prompt has {num_tokens} tokens but this worker's KV cache holds "
            f"{kv_capacity}, leaving no room for output.", "prompt")
    if max_tokens is None:
        return
    if num_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_tokens + max_tokens} tokens ({num_tokens} in the prompt, "
            f"{max_tokens} for the completion).", "max_tokens")
    if kv_capacity is not None and num_tokens + max_tokens > kv_capacity:
        raise InvalidRequestError(
            f"This worker's KV cache holds {kv_capacity} tokens. However, you requested "
            f"{num_tokens + max_tokens} tokens ({num_tokens} in the prompt, {max_tokens} for "
            "the completion).", "max_tokens")
