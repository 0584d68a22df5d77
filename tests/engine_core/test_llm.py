"""Offline LLM: sampling options end output exactly where they should; seeds reproduce."""

from __future__ import annotations

import pytest

from engine_core import LLM, SamplingParams
from engine_core.errors import InvalidRequestError
from engine_core.messages import AddRequest


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama")))


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible(llm):
    prompts = ["hello world", "the quick brown fox", "a"]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=16, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # Different batch composition, same seeds: same tokens.
    second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params)][::-1]
    assert first == second
    other = llm.generate(prompts, SamplingParams(temperature=0.9, seed=7, max_tokens=16,
                                                 ignore_eos=True))
    assert [o.outputs[0].token_ids for o in other] != first


def test_top_k_one_equals_greedy(llm):
    prompts = ["one two three", "four five"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))]
    assert got == want


def test_stop_token_ids_end_output_at_the_token(llm):
    base = llm.generate(["stop tokens"], greedy())[0].outputs[0]
    stop_id = base.token_ids[5]
    first_hit = base.token_ids.index(stop_id)
    out = llm.generate(["stop tokens"], greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first_hit + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_string_ends_text_exactly(llm):
    base = llm.generate(["stop strings"], greedy(max_tokens=20))[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[4:7]
    first = base.text.find(stop)
    out = llm.generate(["stop strings"], greedy(max_tokens=20, stop=[stop]))[0].outputs[0]
    assert out.text == base.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(["stop strings"], greedy(max_tokens=20, stop=[stop],
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:first + len(stop)]
    manager = llm.engine.kv_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_max_tokens_and_finish_reason_length(llm):
    result = llm.generate([[5, 6, 7]], greedy(max_tokens=7))[0]
    out = result.outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and result.finished
    assert result.prompt_token_ids == [5, 6, 7] and result.prompt is None
    assert result.metrics.ttft is not None and result.metrics.ttft >= 0


def test_logprobs_returned_per_token(llm):
    out = llm.generate(["logprobs"], greedy(max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token and len(entry.top) == 3
        assert entry.top[0].token_id == token  # greedy picks the top-1


def test_invalid_requests_are_rejected(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1] * 2000], greedy())
    with pytest.raises(InvalidRequestError):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError, match="fans n out"):  # LLM and the server do
        llm.engine.add_request(AddRequest("n2", [1, 2, 3],
                                          SamplingParams(n=2, max_tokens=2).to_dict(), 0.0))
    with pytest.raises(InvalidRequestError):
        llm.generate([[]], greedy())


def test_n_samples_are_separate_requests(llm):
    """n > 1 fans out into n engine requests (seeds seed + i, as the server does)."""
    [out] = llm.generate([[1, 2, 3]], SamplingParams(n=3, max_tokens=4, temperature=1.0,
                                                     seed=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(len(c.token_ids) == 4 for c in out.outputs)
    again = [llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=1.0, seed=s,
                                                      ignore_eos=True))[0].outputs[0].token_ids
             for s in (5, 6, 7)]
    assert [c.token_ids for c in out.outputs] == again


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3, 8])
def test_abort_mid_prefill_or_decode_frees_every_block(tiny_checkpoint, steps_before_abort):
    """Aborts at any point (queued, mid-prefill chunk, mid-decode) leave the pool whole."""
    import time

    from engine_core.messages import AddRequest

    llm = LLM(str(tiny_checkpoint("llama")), max_num_batched_tokens=32)
    engine = llm.engine
    params = greedy(max_tokens=30).to_dict()
    for i, length in enumerate((100, 40, 5)):
        engine.add_request(AddRequest(f"r{i}", list(range(10, 10 + length)), params,
                                      time.monotonic()))
    for _ in range(steps_before_abort):
        engine.step()
    engine.abort_requests(["r0", "r1", "r2"])
    finished = {o.request_id: o.finish_reason for o in engine.step() if o.finish_reason}
    assert finished == {"r0": "abort", "r1": "abort", "r2": "abort"}
    assert not engine.has_work()
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_max_model_len_beyond_the_trained_length_is_refused(tiny_checkpoint, monkeypatch):
    """As vLLM: a --max-model-len past max_position_embeddings (times a RoPE scaling factor)
    is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; positions past the trained length give
    garbage, not an error, so it used to be accepted without a word."""
    import dataclasses

    from engine_core.errors import ConfigError
    from engine_core.worker.loader import read_model_spec

    path = tiny_checkpoint("qwen3")
    trained = read_model_spec(path).max_position_embeddings
    with pytest.raises(ConfigError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        LLM(str(path), max_model_len=trained + 1)
    assert LLM(str(path), max_model_len=trained + 1,
               allow_long_max_model_len=True).engine.max_model_len == trained + 1
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(str(path), max_model_len=trained + 1).engine.max_model_len == trained + 1
    spec = read_model_spec(path)
    yarn = dataclasses.replace(spec, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 512})
    assert yarn.trained_max_len == 2048
    linear = dataclasses.replace(spec, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert linear.trained_max_len == 2 * spec.max_position_embeddings
    llama3 = dataclasses.replace(spec, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert llama3.trained_max_len == spec.max_position_embeddings


def test_prompt_forms_are_vllms(llm):
    """Text, token ids, {"prompt"} and {"prompt_token_ids"} prompts, alone or in a list,
    give the same tokens for the same ids, in vLLM's RequestOutput shape."""
    text = "the quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    params = greedy(max_tokens=5)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, params)
    assert [o.prompt for o in outputs] == [text, None, text, None]
    assert all(o.prompt_token_ids == ids and o.finished for o in outputs)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert all(len(o.outputs) == 1 and o.outputs[0].index == 0 for o in outputs)
    for single in forms:
        (alone,) = llm.generate(single, params)
        assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError):
        llm.generate({"text": text}, params)


def test_chat_applies_the_models_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    params = greedy(max_tokens=4)
    (out,) = llm.chat(messages, params)
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    (same,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    assert len(llm.chat([messages, messages + [{"role": "assistant", "content": "hi"}]],
                        params)) == 2
