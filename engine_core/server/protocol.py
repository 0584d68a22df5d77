"""OpenAI request bodies: type-checked once, turned into plain dataclasses and SamplingParams.

Every problem raises ``InvalidRequestError`` naming the offending parameter; unknown fields
are refused rather than silently ignored, so typos and unsupported features are visible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.sampling_params import SamplingParams

MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant")

_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
    "seed": (int,), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "repetition_penalty": (int, float), "ignore_eos": (bool,), "min_tokens": (int,),
    "skip_special_tokens": (bool,), "include_stop_str_in_output": (bool,), "n": (int,),
}
_COMMON_FIELDS = {"model", "stream", "stream_options", "stop", "stop_token_ids", "max_tokens",
                  "allowed_token_ids", "truncate_prompt_tokens",
                  "kv_transfer_params", "user", "best_of", "logit_bias", "response_format",
                  *_SAMPLING_FIELDS}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                 "add_generation_prompt", "tools", "tool_choice",
                                 "parallel_tool_calls"}

Prompt = str | list[int]
MAX_PARAMS_DEPTH = 8  # kv_transfer_params nesting (the proxy's are two deep)


# At most this many output tokens may come from elsewhere (the proxy sends one).
MAX_GENERATED_TOKENS = 16
# Choices (prompts x n) of one request: each is an engine request and a task in the server.
MAX_CHOICES = 1024


@dataclass
class Handoff:
    """The proxy's first-token handoff between a prefill and a decode worker.

    ``first_events``: a prefill worker adds the stream's first events (for its sampled
    token) to its answer, for the proxy to send before any decode worker is involved.
    ``generated_token_ids``: a decode worker continues after these output tokens, whose
    text the client already has, and streams only what follows them.
    """

    first_events: bool = False
    generated_token_ids: list[int] = field(default_factory=list)


@dataclass
class CompletionRequest:
    """A validated /v1/completions body; ``prompts`` holds one entry per choice."""

    model: str | None
    prompts: list[Prompt]
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    handoff: Handoff
    echo: bool = False  # each choice's text starts with its prompt
    continuous_usage: bool = False  # usage so far on every chunk of a stream
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens


@dataclass
class ChatCompletionRequest:
    """A validated /v1/chat/completions body; messages reduced to role and text."""

    model: str | None
    messages: list[dict[str, str]]
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    add_generation_prompt: bool
    kv_transfer_params: dict[str, Any] | None
    handoff: Handoff
    continuous_usage: bool = False  # usage so far on every chunk of a stream
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last N tokens (N >= 1)."""
    value = _typed(body, "truncate_prompt_tokens", (int,), None)
    if value is not None and (isinstance(value, bool) or value < 1):
        raise InvalidRequestError("truncate_prompt_tokens must be an integer >= 1",
                                  "truncate_prompt_tokens")
    return value


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body (strict JSON: no NaN or Infinity)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # malformed, bad UTF-8, NaN, an integer of
        # over 4300 digits, nesting deeper than the interpreter's recursion limit
        raise InvalidRequestError(f"request body is not valid JSON: {exc!r:.200}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


def _typed(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise InvalidRequestError(f"{key} has the wrong type (got a boolean)", key)
    if not isinstance(value, types):
        names = " or ".join("number" if t is float else t.__name__ for t in types
                            if not (t is int and float in types))
        raise InvalidRequestError(f"{key} must be a {names}, got {type(value).__name__}", key)
    return value


def _check_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequestError(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    if body.get("best_of") not in (None, 1):
        raise InvalidRequestError("best_of > 1 is not supported", "best_of")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidRequestError("only response_format {'type': 'text'} is supported",
                                  "response_format")
    if body.get("tools"):
        raise InvalidRequestError("tools are not supported", "tools")
    if body.get("suffix"):
        raise InvalidRequestError("suffix is not supported", "suffix")


def stream_options(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage: a final usage chunk, continuous_usage_stats: usage so far on
    every chunk)."""
    stream = _typed(body, "stream", (bool,), False)
    options = _typed(body, "stream_options", (dict,), None)
    if options is None:
        return stream, False, False
    if not stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true",
                                  "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise InvalidRequestError(f"unknown stream_options {sorted(unknown)}", "stream_options")
    include_usage = _typed(options, "include_usage", (bool,), False)
    # As vLLM: usage on every chunk only for streams that ask for usage at all.
    continuous = _typed(options, "continuous_usage_stats", (bool,), False)
    return stream, include_usage, include_usage and continuous


def _kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    params = _typed(body, "kv_transfer_params", (dict,), None)
    if params is not None and not _fits_the_wire(params):
        raise InvalidRequestError(
            f"kv_transfer_params must be JSON of string keys, 64-bit integers and UTF-8 "
            f"strings, nested at most {MAX_PARAMS_DEPTH} deep", "kv_transfer_params")
    return params



def _fits_the_wire(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` can cross the engine socket (msgpack) as it is: before, a lone
    surrogate, an integer past 64 bits or 600 levels of nesting in kv_transfer_params
    failed its encoding with a 500."""
    if depth > MAX_PARAMS_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _fits_the_wire(k, depth)
                   and _fits_the_wire(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_fits_the_wire(v, depth + 1) for v in value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return True
    return isinstance(value, int) and -(1 << 63) <= value < (1 << 64)


def _handoff(params: dict[str, Any] | None) -> Handoff:
    """The handoff fields of ``kv_transfer_params`` (validated; absent means none)."""
    if not params:
        return Handoff()
    first_events = params.get("first_token_events", False)
    if not isinstance(first_events, bool):
        raise InvalidRequestError("kv_transfer_params.first_token_events must be a boolean",
                                  "kv_transfer_params")
    generated = params.get("generated_token_ids", [])
    if (not isinstance(generated, list) or len(generated) > MAX_GENERATED_TOKENS
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in generated)):
        raise InvalidRequestError(
            "kv_transfer_params.generated_token_ids must be a list of at most "
            f"{MAX_GENERATED_TOKENS} non-negative token ids", "kv_transfer_params")
    if first_events and generated:
        raise InvalidRequestError("kv_transfer_params: first_token_events and "
                                  "generated_token_ids exclude each other", "kv_transfer_params")
    return Handoff(first_events, list(generated))


def _sampling_params(body: dict[str, Any], max_tokens: int | None, logprobs: int | None
                     ) -> SamplingParams:
    kwargs: dict[str, Any] = {key: _typed(body, key, types) for key, types in
                              _SAMPLING_FIELDS.items() if body.get(key) is not None}
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop must be a string or a list of strings", "stop")
        if len(stop) > 16:
            raise InvalidRequestError("at most 16 stop strings are allowed", "stop")
        kwargs["stop"] = stop
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids")
        kwargs["stop_token_ids"] = stop_token_ids
    # The engine's SamplingParams validates ranges and names the parameter on error.
    kwargs["logit_bias"] = _logit_bias(body.get("logit_bias"))
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list):
            raise InvalidRequestError("allowed_token_ids must be a list of token ids",
                                      "allowed_token_ids")
        kwargs["allowed_token_ids"] = allowed
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)


def _check_handoff_n(handoff: Handoff, params: SamplingParams) -> None:
    if (handoff.first_events or handoff.generated_token_ids) and params.n != 1:
        raise InvalidRequestError("a first-token handoff carries one sample (n=1)", "n")


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` as ``{token id: bias}`` (ranges: SamplingParams)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias must be an object of token id -> bias",
                                  "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id",
                                      "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequestError("logit_bias values must be numbers", "logit_bias")
        if not -100 <= bias <= 100:  # compared before float(): a huge integer overflows it
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        out[token] = float(bias)
    return out


def _check_logprobs(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{key} must be an integer", key)
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{key} must be in [0, {MAX_LOGPROBS}]", key)
    return value


def _prompts(value: Any) -> list[Prompt]:
    """Text, token ids, or a batch of either."""
    if value is None:
        raise InvalidRequestError("prompt is required", "prompt")
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    else:
        raise InvalidRequestError("prompt must be a non-empty string, list of token ids, "
                                  "or list of those", "prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
        elif isinstance(prompt, list):
            if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                 for t in prompt):
                raise InvalidRequestError(
                    "a token-id prompt must be a non-empty list of non-negative integers", "prompt")
        else:
            raise InvalidRequestError("each prompt must be a string or a list of token ids",
                                      "prompt")
    return prompts


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...], default: int | None) -> int | None:
    for key in keys:
        value = _typed(body, key, (int,))
        if value is not None:
            if value < 1:
                raise InvalidRequestError(f"{key} must be at least 1", key)
            return value
    return default


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body."""
    _check_unsupported(body, _COMPLETION_FIELDS)
    model = _typed(body, "model", (str,))
    prompts = _prompts(body.get("prompt"))
    stream, include_usage, continuous_usage = stream_options(body)
    logprobs = _check_logprobs(body.get("logprobs"), "logprobs")
    params = _sampling_params(body, _max_tokens(body, ("max_tokens",), 16), logprobs)
    if len(prompts) * params.n > MAX_CHOICES:
        raise InvalidRequestError(f"{len(prompts)} prompts x n={params.n} is more than "
                                  f"{MAX_CHOICES} choices in one request", "prompt")
    kv_params = _kv_transfer_params(body)
    handoff = _handoff(kv_params)
    if (handoff.first_events or handoff.generated_token_ids) and len(prompts) != 1:
        raise InvalidRequestError("a first-token handoff needs exactly one prompt", "prompt")
    _check_handoff_n(handoff, params)
    echo = _typed(body, "echo", (bool,), False)
    if echo and params.logprobs is not None:
        raise InvalidRequestError("echo with logprobs needs the prompt's logprobs, which are "
                                  "not supported", "echo")
    if echo and (handoff.first_events or handoff.generated_token_ids):
        raise InvalidRequestError("echo cannot be combined with a first-token handoff", "echo")
    return CompletionRequest(model, prompts, params, stream, include_usage, kv_params, handoff,
                             echo, continuous_usage, _truncate_prompt_tokens(body))


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins a message's text parts
    if content is None:
        return ""
    raise InvalidRequestError(f"messages[{index}].content must be a string or text parts",
                              "messages")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                "messages")
        messages.append({"role": role, "content": _message_text(message.get("content"), index)})
    return messages


def parse_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """Validate a /v1/chat/completions body."""
    _check_unsupported(body, _CHAT_FIELDS)
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidRequestError("tool_choice is not supported", "tool_choice")
    model = _typed(body, "model", (str,))
    messages = _messages(body.get("messages"))
    stream, include_usage, continuous_usage = stream_options(body)
    want_logprobs = _typed(body, "logprobs", (bool,), False)
    top_logprobs = _check_logprobs(body.get("top_logprobs"), "top_logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    params = _sampling_params(body, max_tokens, logprobs)
    add_generation_prompt = _typed(body, "add_generation_prompt", (bool,), True)
    kv_params = _kv_transfer_params(body)
    handoff = _handoff(kv_params)
    _check_handoff_n(handoff, params)
    return ChatCompletionRequest(model, messages, params, stream, include_usage,
                                 add_generation_prompt, kv_params, handoff, continuous_usage,
                                 _truncate_prompt_tokens(body))


def parse_tokenize_request(body: dict[str, Any]) -> tuple[str | None, Any, bool, bool]:
    """(model, prompt-or-messages, is_chat, add_special_tokens) of a /tokenize body."""
    _check_unsupported(body, {"model", "prompt", "messages", "add_special_tokens",
                              "add_generation_prompt"})
    model = _typed(body, "model", (str,))
    add_special = _typed(body, "add_special_tokens", (bool,), True)
    if "messages" in body:
        return model, _messages(body["messages"]), True, add_special
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string", "prompt")
    return model, prompt, False, add_special


def parse_detokenize_request(body: dict[str, Any]) -> tuple[str | None, list[int]]:
    """(model, token ids) of a /detokenize body."""
    _check_unsupported(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        raise InvalidRequestError("tokens must be a list of non-negative integers", "tokens")
    return _typed(body, "model", (str,)), tokens
