"""The official openai client against a real server; outputs equal offline LLM.generate."""

from __future__ import annotations

import openai
import pytest

from engine_core.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

PROMPTS = ["Hello, my name is", "The capital of France is", "日本語 and emoji 🎉 in a prompt"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _offline_requests(llm, prompts, **params):
    return llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, **params)
                                  for _ in prompts])


def _offline(llm, prompts, **params):
    """Each prompt's one completion (text, token ids, logprobs)."""
    return [o.outputs[0] for o in _offline_requests(llm, prompts, **params)]


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 42}])
def test_completions_match_offline(oai, offline_llm, params):
    expected = _offline_requests(offline_llm, PROMPTS, **params)
    for prompt, request in zip(PROMPTS, expected, strict=True):
        want = request.outputs[0]
        got = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                     **params)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(request.prompt_token_ids)
        assert got.usage.completion_tokens == MAX_TOKENS
        assert got.usage.total_tokens == len(request.prompt_token_ids) + MAX_TOKENS
        assert got.usage.prompt_tokens_details.cached_tokens >= 0
        stream = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                        stream=True, stream_options={"include_usage": True},
                                        **params)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completions_batch_and_token_ids(oai, offline_llm):
    expected = _offline_requests(offline_llm, PROMPTS, temperature=0.0)
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                 temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [e.outputs[0].text for e in expected]
    assert got.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)
    ids = expected[0].prompt_token_ids
    by_ids = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert by_ids.choices[0].text == expected[0].outputs[0].text
    # A repeated prompt hits the prefix cache for its full blocks and says so.
    long_ids = (ids * 20)[:40]
    oai.completions.create(model=MODEL_NAME, prompt=long_ids, max_tokens=2, temperature=0)
    again = oai.completions.create(model=MODEL_NAME, prompt=long_ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}])
def test_chat_matches_offline(oai, offline_llm, params):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    prompt_ids = offline_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=False)
    prompt_ids = offline_llm.tokenizer.encode(prompt_ids, add_special_tokens=False)
    want = _offline(offline_llm, [prompt_ids], ignore_eos=True, **params)[0]
    got = oai.chat.completions.create(model=MODEL_NAME, messages=messages,
                                      max_completion_tokens=MAX_TOKENS,
                                      extra_body={"ignore_eos": True}, **params)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == MAX_TOKENS
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=messages,
                                         max_completion_tokens=MAX_TOKENS, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}, **params)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == len(prompt_ids) + MAX_TOKENS


def test_logprobs_shapes(oai, offline_llm):
    want = _offline(offline_llm, PROMPTS[:1], temperature=0.0, logprobs=3)[0]
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                 temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == MAX_TOKENS
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_stop_string_finishes_with_stop(oai, offline_llm):
    full = _offline(offline_llm, PROMPTS[:1], temperature=0.0)[0].text
    stop = full[3:6]
    want = offline_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                            stop=[stop]))[0].outputs[0]
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                 temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == want.text
    assert stop not in got.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
        stream=True))
    assert streamed == want.text


def test_models_and_auth(oai, server):
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", max_tokens=1)


def test_logit_bias_through_the_api(oai, offline_llm):
    """OpenAI's string-keyed logit_bias reaches the sampler: equal to offline generate with
    the same biases, and a banned token never appears."""
    plain = _offline(offline_llm, PROMPTS[:1], temperature=0.0)[0]
    banned = plain.token_ids[0]
    bias = {banned: -100.0, 42: 4.0}
    want = _offline(offline_llm, PROMPTS[:1], temperature=0.0, logit_bias=bias)[0]
    assert want.token_ids != plain.token_ids and banned not in want.token_ids
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                 temperature=0.0, logit_bias={str(k): v for k, v in bias.items()})
    assert got.choices[0].text == want.text
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS, temperature=0.0, logit_bias={str(banned): -100})
    assert chat.choices[0].finish_reason == "length"


def test_echo_prepends_each_prompt(oai):
    """echo: the text is the prompt (token ids decoded) followed by the completion, streamed
    or not; usage counts the completion only."""
    plain = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                   temperature=0.0)
    echoed = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                    temperature=0.0, echo=True)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in
                                                zip(PROMPTS[:2], plain.choices, strict=True)]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                    temperature=0.0, echo=True, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in echoed.choices]
    ids = [150, 11, 616]
    by_ids = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0.0,
                                    echo=True)
    detok = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0.0)
    assert by_ids.choices[0].text.endswith(detok.choices[0].text)
    assert len(by_ids.choices[0].text) > len(detok.choices[0].text)


def test_streamed_text_offsets_equal_the_whole_answers_under_hold_back(oai):
    """text_offset counts the logprob tokens' characters in both paths, also while a stop
    string's possible start is held back (the streamed text then lags the tokens)."""
    plain = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                   temperature=0.0, extra_body={"ignore_eos": True}).choices[0]
    # A stop string that starts like text the answer contains and then never matches: each
    # time that character ends the output so far, it is held back for a chunk or more.
    stop = plain.text.strip()[0] + "\u0001\u0002"
    body = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                logprobs=1, stop=[stop], extra_body={"ignore_eos": True})
    whole = oai.completions.create(**body).choices[0].logprobs
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, **body) if c.choices]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert streamed == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i])
                                 for i in range(len(whole.tokens))]


def test_continuous_usage_stats_on_every_chunk(oai):
    """stream_options.continuous_usage_stats: each chunk carries the usage so far, growing
    to the final count (it was accepted and ignored before)."""
    for create, extra in ((oai.completions.create, {"prompt": PROMPTS[0]}),
                          (oai.chat.completions.create,
                           {"messages": [{"role": "user", "content": PROMPTS[0]}]})):
        chunks = list(create(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0,
                             stream=True, stream_options={"include_usage": True,
                                                          "continuous_usage_stats": True},
                             **extra))
        with_choices = [c for c in chunks if c.choices]
        assert with_choices and all(c.usage is not None for c in with_choices)
        counts = [c.usage.completion_tokens for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
        assert len({c.usage.prompt_tokens for c in chunks}) == 1  # known from the start
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        # As vLLM: without include_usage there is no usage, continuous or final.
        quiet = list(create(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0,
                            stream=True, stream_options={"continuous_usage_stats": True},
                            **extra))
        assert quiet and all(c.usage is None for c in quiet)


def test_allowed_token_ids_restrict_the_output(oai, offline_llm):
    allowed = [40, 41, 42, 300]
    want = _offline(offline_llm, PROMPTS[:1], temperature=0.7, seed=3,
                    allowed_token_ids=allowed)[0]
    assert set(want.token_ids) <= set(allowed)
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                 temperature=0.7, seed=3,
                                 extra_body={"allowed_token_ids": allowed})
    assert got.choices[0].text == want.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(oai, offline_llm):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens are used, so a prompt
    longer than the context is served and equals the offline run of those N tokens."""
    ids = [(i * 37) % 900 + 10 for i in range(400)]  # longer than the 256-token context
    want = offline_llm.generate([ids[-50:]], SamplingParams(temperature=0.0,
                                                            max_tokens=MAX_TOKENS))[0].outputs[0]
    got = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"truncate_prompt_tokens": 50})
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == 50
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 400}],
        max_tokens=2, temperature=0.0, extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2)  # not truncated
