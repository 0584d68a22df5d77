"""prompt_logprobs: each prompt position's logprob (and top-k) equals HF transformers'
float32 log_softmax of the previous position's logits, through chunked prefill, with a
cached prefix present, batched with requests that do not ask."""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.errors import InvalidRequestError
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.messages import AddRequest
from tests.engine_core.test_engine_vs_hf import mixed_prompts

TOP_K = 5


@pytest.fixture(scope="module")
def hf_prompt_logprobs():
    """``f(checkpoint, prompt) -> [len(prompt) - 1, vocab]`` float32 log-probabilities of
    prompt tokens 1.. under HF's logits of the positions before them."""
    from transformers import AutoModelForCausalLM

    models: dict[str, torch.nn.Module] = {}

    def run(checkpoint, prompt: list[int]) -> torch.Tensor:
        key = str(checkpoint)
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[key](torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]

    return run


def check_against_hf(result, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    """Position p: the prompt token's logprob and rank, and the k best values, as HF's."""
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for position in range(1, len(prompt)):
        entry, row = got[position], expected[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(k).values.tolist(),
                                                           abs=1e-4)
        assert len(entry) == k + (entry[token].rank > k)


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 32},  # prompts longer than a chunk
    {"num_gpu_blocks_override": 14, "max_num_batched_tokens": 64},  # preemption by recompute
], ids=["whole", "chunked", "preemption"])
def test_prompt_logprobs_match_hf(tiny_checkpoint, hf_prompt_logprobs, engine_args) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = [p for p in mixed_prompts() if len(p) > 1][:10]
    llm = LLM(str(path), block_size=16, **engine_args)
    asking = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            prompt_logprobs=TOP_K)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = llm.generate(prompts + prompts, [asking] * len(prompts) + [plain] * len(prompts))
    for prompt, result in zip(prompts, results[:len(prompts)]):
        check_against_hf(result, prompt, hf_prompt_logprobs(path, prompt), TOP_K)
    assert all(r.prompt_logprobs is None for r in results[len(prompts):])
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.get_stats().num_preemptions > 0
    # Asking changes nothing of what is sampled.
    assert ([r.outputs[0].token_ids for r in results[:len(prompts)]]
            == [r.outputs[0].token_ids for r in results[len(prompts):]])


def test_prompt_logprobs_with_a_cached_prefix(tiny_checkpoint, hf_prompt_logprobs) -> None:
    """A prompt whose prefix the cache holds still scores every position (the request
    computes them instead of taking the hit); k 0 gives the prompt token's entry alone."""
    path = tiny_checkpoint("llama")
    prompt = mixed_prompts()[-1]  # a 40-token shared prefix plus 70
    llm = LLM(str(path), block_size=16, max_num_batched_tokens=48)
    warm = llm.generate([prompt[:50]], SamplingParams(temperature=0.0, max_tokens=1))
    assert warm[0].prompt_logprobs is None
    for k in (0, 3):
        [result] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                         prompt_logprobs=k))
        expected = hf_prompt_logprobs(path, prompt)
        check_against_hf(result, prompt, expected, k)
        if k == 0:
            assert all(len(entry) == 1 for entry in result.prompt_logprobs[1:])
    # The cache held the prefix all along: a plain request takes it.
    [plain] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert plain.num_cached_tokens >= 48
    # A request whose KV a peer sends cannot score its prompt here.
    remote = AddRequest("remote", prompt, SamplingParams(prompt_logprobs=1).to_dict(), 0.0,
                        KVTransferParams(do_remote_prefill=True))
    with pytest.raises(InvalidRequestError, match="prompt logprobs"):
        llm.engine.validate(remote)


def test_prompt_logprobs_bounds() -> None:
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
