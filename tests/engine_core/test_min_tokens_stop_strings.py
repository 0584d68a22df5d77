"""min_tokens holds back stop strings too, as it holds back EOS and stop token ids (vLLM).

A stop string that appeared in the first ``min_tokens`` tokens' text used to end the request
there, with fewer tokens than the client's min_tokens; vLLM checks stop strings only once
more than ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

import pytest

from engine_core import LLM, SamplingParams
from engine_core.detokenizer import IncrementalDetokenizer
from engine_core.messages import EngineOutput
from engine_core.output_processor import RequestState
from tests.engine_core.test_detokenizer import tokenizer  # noqa: F401  (fixture)

TEXT = "hello world, the quick brown fox jumps over the lazy dog."


def _expected(tok, ids: list[int], stop: str, min_tokens: int) -> str:
    """vLLM's rule: after token i > min_tokens, the first stop ending in token i's text."""
    for i in range(min_tokens + 1, len(ids) + 1):
        before = tok.decode(ids[:i - 1])
        text = tok.decode(ids[:i])
        index = text.find(stop, max(0, len(before) - len(stop) + 1))
        if index >= 0:
            return text[:index]
    return tok.decode(ids)


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 6, 10])
@pytest.mark.parametrize("stop", ["o", "the", "fox"])
def test_stop_strings_wait_for_min_tokens(tokenizer, stop, min_tokens):  # noqa: F811
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    state = RequestState.create("r", [], SamplingParams(stop=[stop], min_tokens=min_tokens,
                                                        max_tokens=len(ids)), tokenizer)
    for count, token in enumerate(ids, start=1):
        delta = state.process(EngineOutput("r", [token], 0, 0))
        if delta.finished:
            assert count > min_tokens
            assert delta.stop_reason == stop
            break
    assert state.output_text == _expected(tokenizer, ids, stop, min_tokens)


def test_detokenizer_default_min_tokens_is_zero(tokenizer):  # noqa: F811
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["o"])
    text = "".join(detok.update([t]).text for t in ids[:3])
    assert detok.stopped and text == "hell"


def test_llm_min_tokens_with_a_stop_string_in_the_first_token(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")))
    prompt = [5, 6, 7, 8, 9]
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                 ignore_eos=True))[0].outputs[0]
    first = llm.tokenizer.decode(base.token_ids[:1]).strip()
    assert first, "the first greedy token must have visible text"
    stop = first[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                                ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert len(out.token_ids) > 6
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    early = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
