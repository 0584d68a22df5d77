"""Prompt logprobs at the HTTP edge: vLLM's ``prompt_logprobs`` request field, OpenAI's
``echo`` with ``logprobs`` (the prompt's tokens and logprobs before the completion's), and
the compact form a prefill worker answers with for the decode worker (through the proxy).

A disaggregated request's prompt is computed on P, so P's engine scores it; P's prefill-only
answer carries ``pdserve_prompt_logprobs`` (one compact entry per prompt), the proxy puts
it in D's ``kv_transfer_params.prompt_logprobs`` (``PromptLogprobColumns``, checked when
the body is parsed), and D answers with them as its own,
computing none (docs/design/api-server.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.kv_transfer_params import (
    PARAM,
    PROMPT_LOGPROBS,
    KVTransferParams,
    PromptLogprobColumns,
)
from engine_core.messages import TokenLogprob
from engine_core.prompt_logprobs import prompt_logprobs_json
from engine_core.sampling_params import SamplingParams

ANSWER_KEY = "pdserve_prompt_logprobs"  # P's prefill-only answer
# vLLM clamps legacy completions logprobs so that JSON never carries -inf.
MIN_JSON_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def requested_prompt_logprobs(body: dict[str, Any], stream: bool, echo: bool,
                              logprobs: int | None) -> int | None:
    """The engine's ``prompt_logprobs`` for a request body: its own field (not with a
    stream, as vLLM; ``SamplingParams`` checks its type and range), else ``logprobs`` when
    it echoes the prompt with logprobs."""
    value = body.get("prompt_logprobs")
    if value is None:
        return logprobs if echo else None
    if stream:
        raise InvalidRequestError("prompt_logprobs are not available when stream=true",
                                  "prompt_logprobs")
    return value


def prompt_logprobs_field(entries: list[TokenLogprob] | None, text: TokenText
                          ) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` key of a choice (chat: of the answer), when computed."""
    return {} if entries is None else {"prompt_logprobs": prompt_logprobs_json(entries, text)}


def _clamped(value: float) -> float:
    return max(value, MIN_JSON_LOGPROB)


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob], text: TokenText,
                  completion: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of an echoed prompt (the first token has none), followed by
    ``completion``'s, whose ``text_offset`` values start after the prompt's characters."""
    tokens = [text(t) for t in prompt_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float] | None] = [None]
    for entry in entries:
        alternatives = {text(t): _clamped(v)
                        for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
        alternatives.setdefault(text(entry.token_id), _clamped(entry.logprob))
        top.append(alternatives)
    out = {"tokens": tokens,
           "token_logprobs": [None, *(_clamped(e.logprob) for e in entries)],
           "top_logprobs": top, "text_offset": offsets}
    for key, values in (completion or {}).items():
        out[key] = out[key] + values
    return out


def echo_chunk(head: dict[str, Any], index: int, prompt_ids: list[int], echo: str,
               entries: list[TokenLogprob] | None, text: TokenText) -> dict[str, Any]:
    """A streamed choice's echoed prompt, with its logprobs when ``entries`` are given."""
    logprobs = None if entries is None else echo_logprobs(prompt_ids, entries, text)
    return {**head, "choices": [{"index": index, "text": echo, "logprobs": logprobs,
                                 "finish_reason": None, "stop_reason": None}]}


def prompt_chars(prompt_ids: list[int], text: TokenText) -> int:
    """Characters of the prompt's token texts: where the completion's offsets start."""
    return sum(len(text(t)) for t in prompt_ids)


# ---- P -> proxy -> D --------------------------------------------------------------------


def to_wire(entries: list[TokenLogprob]) -> dict[str, list[Any]]:
    """One prompt's entries as columns: the JSON of a ``PromptLogprobColumns``."""
    return {"token_ids": [e.token_id for e in entries],
            "logprobs": [e.logprob for e in entries],
            "ranks": [e.rank for e in entries],
            "top_token_ids": [e.top_token_ids for e in entries],
            "top_logprobs": [e.top_logprobs for e in entries]}


def for_decode_leg(choices: Sequence[Any], jobs: Sequence[Any]) -> dict[str, Any]:
    """A prefill-only answer's ``ANSWER_KEY``: each prompt's logprobs (from its sample 0's
    choice), when its engine computed them."""
    firsts = [choice.prompt_logprobs for choice, job in zip(choices, jobs, strict=True)
              if job.sample == 0]
    if not firsts or any(entries is None for entries in firsts):
        return {}
    return {ANSWER_KEY: [to_wire(entries) for entries in firsts]}


def _bad(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}.{PROMPT_LOGPROBS}: {why}", PARAM)


def _entries(columns: PromptLogprobColumns, prompt_ids: list[int], k: int
             ) -> list[TokenLogprob]:
    """One prompt's entries from D's request, checked against its prompt and ``k``."""
    if list(columns.token_ids) != prompt_ids[1:]:
        raise _bad("token_ids are not this prompt's (its positions after the first)")
    if columns.token_ids and columns.num_top != k:
        raise _bad(f"each position needs {k} top ids and logprobs (prompt_logprobs={k})")
    return [TokenLogprob(token, logprob, rank, list(ids), list(values))
            for token, logprob, rank, ids, values in zip(
                columns.token_ids, columns.logprobs, columns.ranks, columns.top_token_ids,
                columns.top_logprobs, strict=True)]


def given_prompt_logprobs(kv_transfer_params: KVTransferParams | None,
                          prompts: list[list[int]], params: SamplingParams
                          ) -> list[list[TokenLogprob]] | None:
    """The prompt logprobs a decode leg received from its prefill worker, one list per
    prompt; None when it received none or its request asks for none."""
    given = None if kv_transfer_params is None else kv_transfer_params.prompt_logprobs
    if given is None or params.prompt_logprobs is None:
        return None
    if len(given) != len(prompts):
        raise _bad(f"must be a list of {len(prompts)} entries, one per prompt")
    return [_entries(columns, ids, params.prompt_logprobs)
            for columns, ids in zip(given, prompts, strict=True)]


def without_given(kv_transfer_params: KVTransferParams | None) -> KVTransferParams | None:
    """The transfer params the engine gets: without the (large) given prompt logprobs."""
    if kv_transfer_params is None or kv_transfer_params.prompt_logprobs is None:
        return kv_transfer_params
    return dataclasses.replace(kv_transfer_params, prompt_logprobs=None)
