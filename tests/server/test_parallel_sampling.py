"""n samples per prompt (OpenAI's ``n``): one engine request per sample, in choice order.

Each sample equals the offline engine run alone with the sample's parameters (a seeded
request's sample ``s`` draws with ``seed + s``); usage counts each prompt once and every
sample's completion; streams carry every choice index (chat: a role chunk each).
"""

from __future__ import annotations

import openai
import pytest

from engine_core.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

PROMPTS = ["Hello, my name is", "The capital of France is"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _want(llm, prompt: str, n: int, **params) -> list:
    """Offline outputs of each sample: ``seed + s`` for sample ``s`` when seeded."""
    seed = params.pop("seed", None)
    return [llm.generate([prompt], SamplingParams(
        max_tokens=MAX_TOKENS, seed=None if seed is None else seed + s, **params))[0]
        for s in range(n)]


def _histogram(server, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram on the server's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    scrape = urllib.request.Request(server.url + "/metrics",
                                    headers={"Authorization": f"Bearer {API_KEY}"})
    text = urllib.request.urlopen(scrape, timeout=30).read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in (f"{name}_count", f"{name}_sum")}
    return values[f"{name}_count"], values[f"{name}_sum"]


def test_completions_n_samples_per_prompt(oai, offline_llm, server) -> None:
    n_before = _histogram(server, "vllm:request_params_n")
    longest_before = _histogram(server, "vllm:request_max_num_generation_tokens")
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, n=3, max_tokens=MAX_TOKENS,
                                 temperature=1.0, seed=11)
    want = [w for p in PROMPTS for w in _want(offline_llm, p, 3, temperature=1.0, seed=11)]
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert len({c.text for c in got.choices[:3]}) > 1  # distinct draws per sample
    prompt_tokens = sum(len(want[3 * i].prompt_token_ids) for i in range(len(PROMPTS)))
    assert got.usage.prompt_tokens == prompt_tokens  # each prompt once
    assert got.usage.completion_tokens == 6 * MAX_TOKENS
    # vLLM's sequence-group series: each prompt's group of 3 once, with its longest output.
    n_after = _histogram(server, "vllm:request_params_n")
    longest_after = _histogram(server, "vllm:request_max_num_generation_tokens")
    assert (n_after[0] - n_before[0], n_after[1] - n_before[1]) == (2, 6)
    assert (longest_after[0] - longest_before[0],
            longest_after[1] - longest_before[1]) == (2, 2 * MAX_TOKENS)
    stream = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, n=3,
                                    max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
                                    stream=True, stream_options={"include_usage": True})
    texts = [""] * 6
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [w.outputs[0].text for w in want]
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == 6 * MAX_TOKENS


def test_chat_n_greedy_samples_agree_and_stream_every_index(oai) -> None:
    messages = [{"role": "user", "content": "name three colours"}]
    one = oai.chat.completions.create(model=MODEL_NAME, messages=messages,
                                      max_tokens=MAX_TOKENS, temperature=0.0)
    many = oai.chat.completions.create(model=MODEL_NAME, messages=messages, n=4,
                                       max_tokens=MAX_TOKENS, temperature=0.0)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 4
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 4 * one.usage.completion_tokens
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=messages, n=4,
                                         max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    texts, roles = [""] * 4, [0] * 4
    for chunk in stream:
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
    assert roles == [1] * 4 and texts == [one.choices[0].message.content] * 4
