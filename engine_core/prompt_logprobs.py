"""Prompt logprobs as callers receive them: vLLM's ``PromptLogprobs`` shape (a list over
prompt positions, ``None`` at the first, else token id -> ``Logprob``) and its JSON form."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_core.messages import TokenLogprob


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's logprob at a position, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


def position_logprobs(entry: TokenLogprob, text: Callable[[int], str]) -> dict[int, Logprob]:
    """The prompt token's entry first, then the top-k (rank i + 1) not already there."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (token_id, value) in enumerate(zip(entry.top_token_ids, entry.top_logprobs,
                                                  strict=True), start=1):
        out.setdefault(token_id, Logprob(value, rank, text(token_id)))
    return out


def to_prompt_logprobs(entries: list[TokenLogprob], text: Callable[[int], str]
                       ) -> PromptLogprobs:
    """The engine's entries (positions 1..) as vLLM's list, ``None`` at position 0."""
    return [None, *(position_logprobs(entry, text) for entry in entries)]


def prompt_logprobs_json(entries: list[TokenLogprob], text: Callable[[int], str]
                         ) -> list[dict[str, Any] | None]:
    """The JSON vLLM's server answers with: token id strings as keys."""
    return [None if position is None else
            {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": lp.decoded_token}
             for token_id, lp in position.items()}
            for position in to_prompt_logprobs(entries, text)]
