"""One HTTP request as engine requests: a ``Job`` per sample of each prompt.

The rules for ids, prefill-only legs, each sample's parameters and which sample moves a
prompt's KV.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from engine_core.kv_transfer_params import KVTransferParams
from engine_core.messages import TokenLogprob
from engine_core.sampling_params import SamplingParams
from engine_core.server import protocol


@dataclass
class Job:
    """One engine request of an HTTP request: one sample of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # this sample's (n 1; a seed offset by the sample's index)
    kv_transfer_params: KVTransferParams | None
    prompt_index: int = 0
    sample: int = 0  # index among the prompt's n samples; sample 0 counts the prompt in usage
    # A later sample of a prompt whose KV moves between workers waits for sample 0's first
    # token (on D its KV from P has landed and is cached by then; on P it is computed and
    # cached), then finds the prompt in the prefix cache.
    after: int | None = None
    # Output tokens this sample continues after (the handoff: the client has their text).
    generated_token_ids: list[int] = field(default_factory=list)
    # The prompt's logprobs computed by the prefill worker (a decode leg answers with them).
    prompt_logprobs: list[TokenLogprob] | None = None


def engine_request_id(request_id: str) -> str:
    """The engine's id for one HTTP request's work: the client's id (still what response
    ids, the X-Request-Id header and logs show) plus a unique suffix, so that concurrent
    requests sharing an ``X-Request-Id`` each run (as vLLM's do) instead of the later ones
    being refused as already in flight."""
    return f"{request_id}-{uuid.uuid4().hex[:16]}"


def prefill_only(kv_transfer_params: KVTransferParams | None, handoff: protocol.Handoff
                 ) -> bool:
    """Whether this worker computes just the prompt's KV and one token for another worker
    to decode: a prefill leg (``do_remote_decode``) or a handoff's first token.

    The proxy sends such a leg the client's own request, so it is validated exactly as the
    decode worker will validate it (context with the real ``max_tokens``, ``n``,
    ``min_tokens``, ``stream_options``, ...) and refused before any KV is computed and held
    for a decode leg that will never pull it; only then is the engine request limited
    (``one_sample_params``) and the answer given as one JSON body, never streamed.
    """
    return handoff.first_events or (kv_transfer_params is not None
                                    and kv_transfer_params.do_remote_decode)


def samples_run(params: SamplingParams, kv_transfer_params: KVTransferParams | None,
                handoff: protocol.Handoff) -> int:
    """Samples a prompt runs here: all ``n``, except on a prefill leg that only computes the
    KV (one); a handoff's prefill samples each choice's first token."""
    if handoff.first_events or not prefill_only(kv_transfer_params, handoff):
        return params.n
    return 1


def moves_kv(kv_transfer_params: KVTransferParams | None) -> bool:
    """Whether this request's sample 0 moves the prompt's KV to or from another worker."""
    return kv_transfer_params is not None and kv_transfer_params.moves_kv


def one_sample_params(params: SamplingParams, one_token: bool) -> SamplingParams:
    """One sample's engine parameters; a prefill-only request samples one token (which
    min_tokens may still keep from being a stop token: it is the client's first token in
    the handoff)."""
    engine_params = dataclasses.replace(params, n=1)
    if one_token:
        engine_params = dataclasses.replace(engine_params, max_tokens=1,
                                            min_tokens=min(params.min_tokens, 1))
    return engine_params


def prompt_transfer_params(params: KVTransferParams | None, prompt_index: int,
                           num_prompts: int) -> KVTransferParams | None:
    """A prompt batch moves one transfer per prompt: ``T-p<i>`` on both P and D."""
    if num_prompts == 1 or params is None or params.transfer_id is None:
        return params
    return dataclasses.replace(params, transfer_id=f"{params.transfer_id}-p{prompt_index}")


def without_transfer(params: KVTransferParams | None) -> KVTransferParams | None:
    """The params of a sample that moves no KV (a prompt's samples after the first)."""
    return None if params is None else params.without_kv_transfer()
