"""OpenAI request bodies: type-checked once, turned into plain dataclasses and SamplingParams.

Every problem raises ``InvalidRequestError`` naming the offending parameter. As in vLLM,
fields no vLLM request has are ignored with one warning line; vLLM's fields this server
cannot honour are refused unless they ask for nothing, so a feature is never silently lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.models.generation_config import GenerationDefaults
from engine_core.request_limits import MAX_CHOICES
from engine_core.sampling_params import SamplingParams
from engine_core.server.chat_messages import parse_messages
from engine_core.server.prompt_logprobs import requested_prompt_logprobs
from engine_core.server.structured_fields import STRUCTURED_FIELDS, structured_outputs_from
from engine_core.server.tools import ToolRequest, parse_tools

logger = logging.getLogger("pdserve.server")

MAX_LOGPROBS = 20

_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
    "seed": (int,), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "repetition_penalty": (int, float), "ignore_eos": (bool,), "min_tokens": (int,),
    "skip_special_tokens": (bool,), "include_stop_str_in_output": (bool,), "n": (int,),
}
# Fields honoured (checked where they are parsed).
_COMMON_FIELDS = {"model", "stream", "stream_options", "stop", "stop_token_ids", "max_tokens",
                  "allowed_token_ids", "truncate_prompt_tokens", "kv_transfer_params",
                  "logit_bias", "add_special_tokens", "user", "prompt_logprobs",
                  *_SAMPLING_FIELDS, *STRUCTURED_FIELDS}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                 "add_generation_prompt", "continue_final_message",
                                 "chat_template_kwargs", "documents", "parallel_tool_calls",
                                 "tools", "tool_choice", "include_reasoning"}
# Honoured fields with no effect here, as in vLLM: type-checked only (user: the client's
# end-user id; include_reasoning without a reasoning parser).
_NO_EFFECT_FIELDS: dict[str, tuple[type, ...]] = {"user": (str,), "include_reasoning": (bool,)}
# vLLM's fields this server cannot honour -> the values that ask for nothing (null always
# does): any other value is a 400 naming the field.
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "use_beam_search": (False,),
    "length_penalty": (1.0,), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "logits_processors": (),
    "bad_words": ([],), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "cache_salt": (), "vllm_xargs": (), "priority": (0,), "spaces_between_special_tokens": (True,),
    "request_id": (),  # the X-Request-Id header names requests here
}
_UNSUPPORTED_COMPLETION = _UNSUPPORTED_COMMON | {"suffix": ("",), "prompt_embeds": ()}
_UNSUPPORTED_CHAT = _UNSUPPORTED_COMMON | {
    "echo": (False,), "chat_template": (),
    "mm_processor_kwargs": ({},), "reasoning_effort": ()}
_UNSUPPORTED_TOKENIZE = {"continue_final_message": (False,), "chat_template": (),
                         "chat_template_kwargs": ({},), "tools": ([],), "documents": ([],),
                         "mm_processor_kwargs": ({},), "return_token_strs": (False,)}
MAX_IGNORED_NAMES_LOGGED = 10
NO_DEFAULTS = GenerationDefaults()

Prompt = str | list[int]


@dataclass
class Handoff:
    """How a request continues a stream another worker began (the proxy's first-token
    handoff and request migration), from the request's ``KVTransferParams``.

    ``first_events``: a prefill worker samples each choice's first token and adds the
    stream's first events (for those tokens) to its answer, for the proxy to send before
    any decode worker is involved.
    ``generated_token_ids``: one list per choice (the request's ``n``); a decode worker
    continues each choice after its output tokens, whose text the client already has, and
    streams only what follows them (their number is bounded by ``max_tokens``, which
    counts them).
    ``continues``: the client already has the stream's head (a chat's role chunk), so it
    is not sent again; set whenever ``generated_token_ids`` is given, even with empty lists.
    ``stream_token_ids``: each stream event is preceded by an SSE comment line
    ``: pdserve_token_ids=<ids>`` naming the output tokens it completes, so the proxy
    knows what the client holds and can continue the stream elsewhere.
    """

    first_events: bool = False
    generated_token_ids: list[list[int]] = field(default_factory=list)
    continues: bool = False
    stream_token_ids: bool = False

    @property
    def hands_over(self) -> bool:
        """Whether this request is one part of a stream split between workers."""
        return self.first_events or self.continues


@dataclass
class CompletionRequest:
    """A validated /v1/completions body; ``prompts`` holds one entry per choice."""

    model: str | None
    prompts: list[Prompt]
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    kv_transfer_params: KVTransferParams | None
    handoff: Handoff
    echo: bool = False  # each choice's text starts with its prompt
    continuous_usage: bool = False  # usage so far on every chunk of a stream
    truncate_prompt_tokens: int | None = None  # the prompt's last N tokens (-1: the context)
    add_special_tokens: bool = True  # a text prompt's BOS (the tokenizer's special tokens)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat request's messages become its prompt, besides ``add_generation_prompt``
    (vLLM's fields of these names)."""

    continue_final_message: bool = False  # the last (assistant) message left open
    add_special_tokens: bool = False  # the template writes them itself
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables
    tools: list[dict[str, Any]] | None = None  # the request's tools, for the template


@dataclass
class ChatCompletionRequest:
    """A validated /v1/chat/completions body; messages reduced to role, text and (assistant
    and tool messages) their tool-call fields."""

    model: str | None
    messages: list[dict[str, Any]]
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    add_generation_prompt: bool
    kv_transfer_params: KVTransferParams | None
    handoff: Handoff
    continuous_usage: bool = False  # usage so far on every chunk of a stream
    truncate_prompt_tokens: int | None = None  # the prompt's last N tokens (-1: the context)
    template: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)
    tools: ToolRequest | None = None  # declared tools and tool_choice


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last N tokens (N >= 1), or -1 for
    the model's context length (the tokenizer service checks N against that length)."""
    value = _typed(body, "truncate_prompt_tokens", (int,), None)
    if value is not None and value < 1 and value != -1:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or an integer >= 1",
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


def _check_fields(body: dict[str, Any], honoured: set[str],
                  unsupported: dict[str, tuple[Any, ...]]) -> None:
    """vLLM's policy: fields it does not know are ignored with one warning line; here also
    a 400 for a field this server cannot honour set to anything but a neutral value."""
    for key, neutral in unsupported.items():
        value = body.get(key)
        if value is not None and not any(_same(value, n) for n in neutral):
            accepted = " or ".join(json.dumps(n) for n in (*neutral, None))
            raise InvalidRequestError(f"{key} is not supported (only {accepted} is accepted)",
                                      key)
    for key, types in _NO_EFFECT_FIELDS.items():
        if key in honoured:
            _typed(body, key, types)
    ignored = body.keys() - honoured - unsupported.keys()
    if ignored:
        names = sorted(ignored)
        more = f" and {len(names) - MAX_IGNORED_NAMES_LOGGED} more" if len(
            names) > MAX_IGNORED_NAMES_LOGGED else ""
        logger.warning("The following fields were present in the request but ignored: %s%s",
                       [n[:64] for n in names[:MAX_IGNORED_NAMES_LOGGED]], more)


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral``, where a boolean is not a number (``priority: true`` is no 0)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


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


def _kv_transfer_params(body: dict[str, Any]) -> KVTransferParams | None:
    params = _typed(body, "kv_transfer_params", (dict,), None)
    return None if params is None else KVTransferParams.from_wire(params)


def _handoff(params: KVTransferParams | None) -> Handoff:
    """The handoff the request's params ask for (absent params: none)."""
    if params is None:
        return Handoff()
    generated = params.generated_token_ids
    return Handoff(params.first_token_events, [list(ids) for ids in generated or ()],
                   generated is not None, params.stream_token_ids)


def _sampling_params(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                     defaults: GenerationDefaults) -> SamplingParams:
    """The request's SamplingParams: its own values over the generation config's defaults,
    which also adds the model's eos ids to its stop ids unless it sets ignore_eos."""
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
    kwargs["structured_outputs"] = structured_outputs_from(body)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                          **defaults.request_kwargs(kwargs))


def _check_handoff_n(handoff: Handoff, params: SamplingParams) -> None:
    """A continuation names the tokens of every choice (each sample continues its own)."""
    if handoff.generated_token_ids and len(handoff.generated_token_ids) != params.n:
        raise InvalidRequestError(
            f"kv_transfer_params.generated_token_ids has {len(handoff.generated_token_ids)} "
            f"lists; the request has n={params.n} choices", "kv_transfer_params")


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
    """The first of ``keys`` set; None (up to the context, as vLLM) when one is an explicit
    null and none is set; ``default`` when none is present."""
    for key in keys:
        value = _typed(body, key, (int,))
        if value is not None:
            if value < 1:
                raise InvalidRequestError(f"{key} must be at least 1", key)
            return value
    return None if any(key in body for key in keys) else default


def parse_completion_request(body: dict[str, Any], defaults: GenerationDefaults = NO_DEFAULTS
                             ) -> CompletionRequest:
    """Validate a /v1/completions body; ``defaults``: the generation config's."""
    _check_fields(body, _COMPLETION_FIELDS, _UNSUPPORTED_COMPLETION)
    model = _typed(body, "model", (str,))
    prompts = _prompts(body.get("prompt"))
    stream, include_usage, continuous_usage = stream_options(body)
    logprobs = _check_logprobs(body.get("logprobs"), "logprobs")
    params = _sampling_params(body, _max_tokens(body, ("max_tokens",), 16), logprobs, defaults)
    if len(prompts) * params.n > MAX_CHOICES:
        raise InvalidRequestError(f"{len(prompts)} prompts x n={params.n} is more than "
                                  f"{MAX_CHOICES} choices in one request", "prompt")
    kv_params = _kv_transfer_params(body)
    handoff = _handoff(kv_params)
    if handoff.hands_over and len(prompts) != 1:
        raise InvalidRequestError("a first-token handoff needs exactly one prompt", "prompt")
    _check_handoff_n(handoff, params)
    echo = _typed(body, "echo", (bool,), False)
    params = dataclasses.replace(params, prompt_logprobs=requested_prompt_logprobs(
        body, stream, echo and params.logprobs is not None, params.logprobs))
    if echo and handoff.hands_over:
        raise InvalidRequestError("echo cannot be combined with a first-token handoff", "echo")
    return CompletionRequest(model, prompts, params, stream, include_usage, kv_params, handoff,
                             echo, continuous_usage, _truncate_prompt_tokens(body),
                             _typed(body, "add_special_tokens", (bool,), True))


def parse_chat_request(body: dict[str, Any], defaults: GenerationDefaults = NO_DEFAULTS
                       ) -> ChatCompletionRequest:
    """Validate a /v1/chat/completions body; ``defaults``: the generation config's."""
    _check_fields(body, _CHAT_FIELDS, _UNSUPPORTED_CHAT)
    model = _typed(body, "model", (str,))
    messages = parse_messages(body.get("messages"))
    stream, include_usage, continuous_usage = stream_options(body)
    want_logprobs = _typed(body, "logprobs", (bool,), False)
    top_logprobs = _check_logprobs(body.get("top_logprobs"), "top_logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    params = _sampling_params(body, max_tokens, logprobs, defaults)
    tools = parse_tools(body)
    params = _with_tool_constraint(params, tools)
    params = dataclasses.replace(params, prompt_logprobs=requested_prompt_logprobs(
        body, stream, False, None))
    add_generation_prompt = _typed(body, "add_generation_prompt", (bool,), True)
    kv_params = _kv_transfer_params(body)
    handoff = _handoff(kv_params)
    _check_handoff_n(handoff, params)
    return ChatCompletionRequest(model, messages, params, stream, include_usage,
                                 add_generation_prompt, kv_params, handoff, continuous_usage,
                                 _truncate_prompt_tokens(body),
                                 _template_options(body, add_generation_prompt, tools), tools)


def _with_tool_constraint(params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """``params`` constrained to the output a forced tool choice needs."""
    constraint = None if tools is None else tools.constraint()
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError("a required or named tool_choice constrains the output "
                                  "itself; it cannot be combined with another output "
                                  "constraint", "tool_choice")
    return dataclasses.replace(params, structured_outputs=constraint)


def _template_options(body: dict[str, Any], add_generation_prompt: bool,
                      tools: ToolRequest | None = None) -> ChatTemplateOptions:
    continue_final = _typed(body, "continue_final_message", (bool,), False)
    if continue_final and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot "
                                  "both be true", "continue_final_message")
    return ChatTemplateOptions(
        continue_final_message=continue_final,
        add_special_tokens=_typed(body, "add_special_tokens", (bool,), False),
        documents=_documents(body.get("documents")),
        chat_template_kwargs=_typed(body, "chat_template_kwargs", (dict,), {}),
        tools=None if tools is None else list(tools.tools))


def _documents(value: Any) -> list[dict[str, str]] | None:
    """vLLM's ``documents``: a list of objects of strings, for retrieval templates."""
    if value is None:
        return None
    if not isinstance(value, list) or any(
            not isinstance(doc, dict) or any(not isinstance(v, str) for v in doc.values())
            for doc in value):
        raise InvalidRequestError("documents must be a list of objects of strings", "documents")
    return value


def parse_tokenize_request(body: dict[str, Any]) -> tuple[str | None, Any, bool, bool]:
    """(model, prompt-or-messages, is_chat, add_special_tokens) of a /tokenize body."""
    _check_fields(body, {"model", "prompt", "messages", "add_special_tokens",
                         "add_generation_prompt"}, _UNSUPPORTED_TOKENIZE)
    model = _typed(body, "model", (str,))
    add_special = _typed(body, "add_special_tokens", (bool,), True)
    if "messages" in body:
        return model, parse_messages(body["messages"]), True, add_special
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string", "prompt")
    return model, prompt, False, add_special


def parse_detokenize_request(body: dict[str, Any]) -> tuple[str | None, list[int]]:
    """(model, token ids) of a /detokenize body."""
    _check_fields(body, {"model", "tokens"}, {})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        raise InvalidRequestError("tokens must be a list of non-negative integers", "tokens")
    return _typed(body, "model", (str,)), tokens
