"""Prompt logprobs across a disaggregated request: P computes the prompt, so P scores it.

A request asking for them (``prompt_logprobs``, or ``echo`` with ``logprobs``) runs its
legs one after the other: P's answer carries each prompt's logprobs
(``engine_core.server.prompt_logprobs.ANSWER_KEY``), and D's leg leaves with them in its
``kv_transfer_params`` (``PROMPT_LOGPROBS``); D answers with them as its own and computes none.
The first-token handoff never carries them: a stream may not ask for ``prompt_logprobs``
(as vLLM) and an echoing one is not handed off (``forwarding.handoff_refusal``).
"""

from __future__ import annotations

import json
from typing import Any

from engine_core.kv_transfer_params import PROMPT_LOGPROBS
from engine_core.server.prompt_logprobs import ANSWER_KEY
from proxy.forwarding import CHAT_PATH


def wants_prompt_logprobs(path: str, body: dict[str, Any]) -> bool:
    """Whether the request's answer holds its prompt's logprobs (the worker validates the
    values; a malformed one is refused by P before anything is computed)."""
    if body.get("prompt_logprobs") is not None:
        return True
    return path != CHAT_PATH and body.get("echo") is True and body.get("logprobs") is not None


def from_prefill_answer(answer: bytes) -> Any:
    """The prompt logprobs in P's answer (None when absent: D then refuses the request, and
    the KV P holds is released as for any refusal)."""
    try:
        value = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    return value.get(ANSWER_KEY) if isinstance(value, dict) else None


def with_prompt_logprobs(decode_body: dict[str, Any], value: Any) -> dict[str, Any]:
    """D's request carrying P's prompt logprobs."""
    if value is None:
        return decode_body
    params = {**decode_body.get("kv_transfer_params", {}), PROMPT_LOGPROBS: value}
    return {**decode_body, "kv_transfer_params": params}
