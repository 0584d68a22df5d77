"""prompt_logprobs and echo with logprobs through the official openai client: the numbers
equal the offline LLM's, streamed and whole, in vLLM's and OpenAI's shapes."""

from __future__ import annotations

import openai
import pytest

from engine_core.kv_transfer_params import PROMPT_LOGPROBS
from engine_core.sampling_params import SamplingParams
from engine_core.server.prompt_logprobs import ANSWER_KEY
from tests.server.conftest import API_KEY, MODEL_NAME

PROMPTS = ["Hello, my name is", "The capital of France is"]
MAX_TOKENS = 4
K = 3


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(offline_llm):
    """Each prompt's offline result with prompt logprobs and logprobs (k = K)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=K,
                            prompt_logprobs=K)
    return offline_llm.generate(PROMPTS, params)


def check_prompt_logprobs(got, want) -> None:
    """vLLM's JSON (token id strings -> logprob, rank, decoded_token) against the offline
    ``RequestOutput.prompt_logprobs``."""
    assert got[0] is None and len(got) == len(want)
    for position, entry in zip(got[1:], want[1:], strict=True):
        assert {int(t) for t in position} == set(entry)
        for token_id, value in entry.items():
            item = position[str(token_id)]
            assert item["logprob"] == pytest.approx(value.logprob, abs=1e-4)
            assert item["rank"] == value.rank
            assert item["decoded_token"] == value.decoded_token


def test_completions_prompt_logprobs(oai, expected):
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"prompt_logprobs": K})
    for choice in got.choices:
        want = expected[choice.index]
        check_prompt_logprobs(choice.prompt_logprobs, want.prompt_logprobs)
        assert choice.text == want.outputs[0].text
    plain = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None


def test_chat_prompt_logprobs(oai, offline_llm):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    got = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                      temperature=0.0, extra_body={"prompt_logprobs": 1})
    [want] = offline_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=2,
                                                       prompt_logprobs=1))
    check_prompt_logprobs(got.prompt_logprobs, want.prompt_logprobs)


def echo_expected(want) -> tuple[list[str], list[float | None]]:
    """(tokens, token_logprobs) of an echoed prompt and its completion, offline."""
    prompt = want.prompt_token_ids
    logprobs = [None] + [entry[token].logprob
                         for entry, token in zip(want.prompt_logprobs[1:], prompt[1:])]
    tokens = [want.prompt_logprobs[i][t].decoded_token for i, t in enumerate(prompt) if i]
    completion = want.outputs[0].logprobs
    return tokens + [e.token for e in completion], logprobs + [e.logprob for e in completion]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs(oai, expected, stream):
    """The prompt's tokens and logprobs (the first with none) precede the completion's;
    text offsets run on through both; streamed chunks add up to the whole answer."""
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                 temperature=0.0, echo=True, logprobs=K, stream=stream)
    merged: dict[int, dict] = {}
    texts: dict[int, str] = {}
    for chunk in (got if stream else [got]):
        for choice in chunk.choices:
            into = merged.setdefault(choice.index, {"tokens": [], "token_logprobs": [],
                                                    "top_logprobs": [], "text_offset": []})
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                for key in into:
                    into[key] += getattr(choice.logprobs, key)
    for index, want in enumerate(expected):
        logprobs = merged[index]
        tokens, token_logprobs = echo_expected(want)
        assert logprobs["tokens"][1:] == tokens
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(token_logprobs[1:], abs=1e-4)
        assert all(len(top) >= K for top in logprobs["top_logprobs"][1:])
        lengths = [len(t) for t in logprobs["tokens"]]
        assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
        assert texts[index] == PROMPTS[index] + want.outputs[0].text


def test_a_decode_leg_answers_with_the_prefill_workers_values(oai, expected):
    """A prefill-only answer carries each prompt's logprobs; a request given them in its
    ``kv_transfer_params`` (D's leg) answers with those, not its own, and malformed ones
    are a 400."""
    prefill = oai.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"prompt_logprobs": K, "kv_transfer_params": {"do_remote_decode": True}})
    [wire] = prefill.http_response.json()[ANSWER_KEY]
    assert wire["token_ids"] == expected[0].prompt_token_ids[1:]
    shifted = {**wire, "logprobs": [v - 1.0 for v in wire["logprobs"]]}
    got = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"prompt_logprobs": K, "kv_transfer_params": {PROMPT_LOGPROBS: [shifted]}})
    prompt_ids = expected[0].prompt_token_ids
    for position, token, value in zip(got.choices[0].prompt_logprobs[1:], prompt_ids[1:],
                                      shifted["logprobs"], strict=True):
        assert position[str(token)]["logprob"] == pytest.approx(value, abs=1e-6)
    bad = {**wire, "token_ids": wire["token_ids"][::-1]}
    with pytest.raises(openai.BadRequestError, match="token_ids"):
        oai.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1,
            extra_body={"prompt_logprobs": K, "kv_transfer_params": {PROMPT_LOGPROBS: [bad]}})
