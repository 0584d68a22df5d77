"""vLLM's request policies: unknown fields ignored with a warning, vLLM's fields we cannot
honour refused by name, chat template options, ``truncate_prompt_tokens`` -1 and its upper
bound, an explicit ``max_tokens: null``, and the generation config's request defaults."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from engine_core.errors import InvalidRequestError
from engine_core.models.generation_config import GenerationDefaults
from engine_core.server import protocol
from engine_core.server.tokenization import TokenizerService
from tests.server.conftest import MAX_MODEL_LEN

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _completion(**fields: object) -> protocol.CompletionRequest:
    return protocol.parse_completion_request({"prompt": "x", **fields})


def _chat(**fields: object) -> protocol.ChatCompletionRequest:
    return protocol.parse_chat_request({"messages": MSG, **fields})


# ---- unknown and unsupported fields -----------------------------------------------------


def test_unknown_fields_are_ignored_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, "pdserve.server")
    req = _chat(metadata={"a": 1}, store=False, frobnicate=1, max_tokens=3)
    assert req.sampling_params.max_tokens == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert all(name in warnings[0].getMessage() for name in ("frobnicate", "metadata", "store"))
    caplog.clear()
    _completion(max_tokens=2, temperature=0)
    assert not caplog.records  # a request of known fields logs nothing


def test_many_unknown_fields_log_a_bounded_line(caplog):
    caplog.set_level(logging.WARNING, "pdserve.server")
    _completion(**{f"x{i:04d}": i for i in range(5000)})
    (record,) = caplog.records
    assert len(record.getMessage()) < 400 and "4990 more" in record.getMessage()


@pytest.mark.parametrize("parse,field,value", [
    (_completion, "best_of", 2), (_completion, "suffix", "s"), (_completion, "priority", 1),
    (_completion, "priority", True), (_completion, "use_beam_search", True),
    (_completion, "guided_decoding_backend", "outlines"),
    (_chat, "guided_whitespace_pattern", " "), (_chat, "cache_salt", "s"),
    (_completion, "bad_words", ["no"]), (_completion, "return_token_ids", True),
    (_completion, "spaces_between_special_tokens", False), (_completion, "request_id", "r"),
    (_chat, "echo", True), (_chat, "chat_template", "{{x}}"),
    (_chat, "reasoning_effort", "low"), (_completion, "prompt_embeds", "AAAA"),
])
def test_fields_we_cannot_honour_are_refused_by_name(parse, field, value):
    with pytest.raises(InvalidRequestError) as exc:
        parse(**{field: value})
    assert exc.value.param == field and field in str(exc.value)


@pytest.mark.parametrize("parse,fields", [
    (_completion, {"prompt_logprobs": None, "best_of": 1, "suffix": "", "priority": 0,
                   "use_beam_search": False, "spaces_between_special_tokens": True,
                   "length_penalty": 1, "bad_words": [], "return_token_ids": False}),
    (_chat, {"tools": [], "tool_choice": "none", "echo": False, "response_format":
             {"type": "text"}, "parallel_tool_calls": True, "include_reasoning": True,
             "user": "u", "mm_processor_kwargs": {}}),
])
def test_neutral_values_of_those_fields_are_accepted(parse, fields):
    parse(**fields)


@pytest.mark.parametrize("parse,field,value", [
    (_chat, "chat_template_kwargs", ["enable_thinking"]), (_chat, "continue_final_message", 1),
    (_chat, "documents", [{"title": 5}]), (_chat, "documents", "doc"),
    (_chat, "add_special_tokens", "yes"), (_completion, "add_special_tokens", 1),
    (_chat, "user", 5), (_chat, "parallel_tool_calls", "yes"), (_completion, "user", ["u"]),
])
def test_known_fields_of_the_wrong_type_are_refused(parse, field, value):
    with pytest.raises(InvalidRequestError) as exc:
        parse(**{field: value})
    assert exc.value.param == field


def test_chat_template_options_are_parsed():
    req = _chat(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False,
                continue_final_message=True, add_special_tokens=True,
                documents=[{"title": "t", "text": "x"}])
    assert req.template == protocol.ChatTemplateOptions(
        continue_final_message=True, add_special_tokens=True,
        documents=[{"title": "t", "text": "x"}], chat_template_kwargs={"enable_thinking": False})
    assert _chat().template == protocol.ChatTemplateOptions()
    assert _completion(add_special_tokens=False).add_special_tokens is False
    with pytest.raises(InvalidRequestError) as exc:
        _chat(continue_final_message=True)  # add_generation_prompt defaults to true
    assert exc.value.param == "continue_final_message"


def test_tokenize_ignores_unknown_fields_and_refuses_template_options():
    assert protocol.parse_tokenize_request({"prompt": "a", "foo": 1})[1] == "a"
    with pytest.raises(InvalidRequestError) as exc:
        protocol.parse_tokenize_request({"messages": MSG, "chat_template_kwargs": {"a": 1}})
    assert exc.value.param == "chat_template_kwargs"


# ---- truncate_prompt_tokens and max_tokens ----------------------------------------------


@pytest.mark.parametrize("value", [-1, 1, 2 ** 70])
def test_truncate_prompt_tokens_values_the_parser_accepts(value):
    assert _completion(truncate_prompt_tokens=value).truncate_prompt_tokens == value


@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_truncate_prompt_tokens_values_refused(value):
    with pytest.raises(InvalidRequestError) as exc:
        _chat(truncate_prompt_tokens=value)
    assert exc.value.param == "truncate_prompt_tokens"


def test_explicit_null_max_tokens_means_up_to_the_context():
    assert _completion(max_tokens=None).sampling_params.max_tokens is None
    assert _completion().sampling_params.max_tokens == 16
    assert _chat(max_tokens=None).sampling_params.max_tokens is None
    assert _chat(max_completion_tokens=None, max_tokens=7).sampling_params.max_tokens == 7
    assert _chat(max_completion_tokens=5, max_tokens=None).sampling_params.max_tokens == 5


# ---- generation config defaults ---------------------------------------------------------

DEFAULTS = GenerationDefaults((2,), {"temperature": 0.6, "top_k": 20})


@pytest.mark.parametrize("parse,body", [(protocol.parse_completion_request, {"prompt": "x"}),
                                        (protocol.parse_chat_request, {"messages": MSG})])
def test_generation_defaults_fill_what_the_request_omits(parse, body):
    params = parse({**body, "top_k": 5, "temperature": None}, DEFAULTS).sampling_params
    assert (params.temperature, params.top_k, params.stop_token_ids) == (0.6, 5, [2])
    params = parse({**body, "stop_token_ids": [7], "ignore_eos": True}, DEFAULTS).sampling_params
    assert params.stop_token_ids == [7]
    assert parse(body).sampling_params.temperature == 1.0  # no generation config: vLLM's


# ---- the tokenizer service --------------------------------------------------------------

TEMPLATE = ("{% if enable_thinking %}<think>{% endif %}{% for m in messages %}"
            "{{ m.role }}:{{ m.content }};{% endfor %}{% for d in documents or [] %}"
            "[{{ d.text }}]{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(demo_checkpoint: Path) -> TokenizerService:
    service = TokenizerService.load(str(demo_checkpoint), MAX_MODEL_LEN, 1024)
    service.tokenizer.chat_template = TEMPLATE
    yield service
    service.close()


def _text(service: TokenizerService, **options: object) -> str:
    ids = service.encode_chat(MSG, True, None, protocol.ChatTemplateOptions(**options))
    return service.tokenizer.decode(ids)


def test_chat_template_kwargs_and_documents_reach_the_template(tokenizer):
    assert _text(tokenizer) == "user:hi;assistant:"
    assert _text(tokenizer, chat_template_kwargs={"enable_thinking": True}).startswith("<think>")
    assert "[doc]" in _text(tokenizer, documents=[{"text": "doc"}])
    for reserved in ("tokenize", "chat_template", "add_generation_prompt"):
        with pytest.raises(InvalidRequestError) as exc:
            _text(tokenizer, chat_template_kwargs={reserved: True})
        assert exc.value.param == "chat_template_kwargs"
    assert tokenizer.eos_token_id == 0


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    messages = [*MSG, {"role": "assistant", "content": "Sure, "}]
    ids = tokenizer.encode_chat(messages, False, None,
                                protocol.ChatTemplateOptions(continue_final_message=True))
    assert tokenizer.tokenizer.decode(ids).endswith("assistant:Sure, ")


def test_truncate_prompt_tokens_minus_one_and_its_bound(tokenizer):
    ids = list(range(10, 10 + MAX_MODEL_LEN + 5))
    with pytest.raises(InvalidRequestError) as exc:
        tokenizer.encode_prompt(ids, -1)  # the whole context: no room left for output
    assert exc.value.param == "prompt"
    assert tokenizer.encode_prompt([5, 6, 7], -1) == [5, 6, 7]
    for too_many in (MAX_MODEL_LEN + 1, 2 ** 70):
        with pytest.raises(InvalidRequestError) as exc:
            tokenizer.encode_prompt([5, 6, 7], too_many)
        assert exc.value.param == "truncate_prompt_tokens"
    assert tokenizer.encode_prompt(ids, MAX_MODEL_LEN - 1) == ids[-(MAX_MODEL_LEN - 1):]


# ---- through the server -----------------------------------------------------------------


async def _post(server, auth, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + path, json=body, headers=auth) as response:
            return response.status, await response.json()


async def test_server_ignores_unknown_fields(server, auth):
    status, body = await _post(server, auth, C, {"prompt": "hi", "max_tokens": 2,
                                                 "frobnicate": 1, "store": True})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    status, body = await _post(server, auth, CHAT, {"messages": MSG, "max_tokens": 2,
                                                    "metadata": {"k": "v"}})
    assert status == 200


@pytest.mark.parametrize("path,field,value", [
    (C, "prompt_logprobs", 21), (CHAT, "echo", True), (CHAT, "chat_template", "{{ 1 }}"),
])
async def test_server_refuses_fields_it_cannot_honour(server, auth, path, field, value):
    status, body = await _post(server, auth, path, {"prompt": "hi", "messages": MSG,
                                                    "max_tokens": 2, field: value})
    assert status == 400 and body["error"]["param"] == field


async def test_server_truncate_prompt_tokens(server, auth):
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN + 5))
    status, body = await _post(server, auth, C, {"prompt": [5, 6, 7], "max_tokens": 2,
                                                 "truncate_prompt_tokens": -1})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3
    status, body = await _post(server, auth, C, {"prompt": long_prompt, "max_tokens": 2,
                                                 "truncate_prompt_tokens": MAX_MODEL_LEN - 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 2
    for too_many in (MAX_MODEL_LEN + 1, 2 ** 70):
        status, body = await _post(server, auth, CHAT, {"messages": MSG, "max_tokens": 2,
                                                        "truncate_prompt_tokens": too_many})
        assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"


async def test_server_null_max_tokens_runs_to_the_context(server, auth):
    status, body = await _post(server, auth, C, {"prompt": [5, 6, 7], "max_tokens": None,
                                                 "ignore_eos": True, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3
    assert body["choices"][0]["finish_reason"] == "length"
