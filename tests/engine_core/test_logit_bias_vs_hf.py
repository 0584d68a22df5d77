"""logit_bias: greedy output equals HF transformers `generate` with the same biases
(``sequence_bias`` over one-token sequences), batched with unbiased requests."""

from __future__ import annotations

from engine_core import LLM, SamplingParams
from tests.engine_core.test_engine_vs_hf import mixed_prompts

MAX_NEW = 8


def check_logit_bias_matches_hf(path, hf_greedy, device: str, **engine_args) -> None:
    """Engine greedy with biases equals HF with the same ``sequence_bias``; unbiased requests
    in the same batch equal HF without."""
    prompts = mixed_prompts()[:8]
    plain = hf_greedy(path, prompts, MAX_NEW, device=device)
    # Ban what the unbiased model says first, favour a few tokens mildly (a sum, not a ban,
    # so the choice depends on the logits too).
    bias = {out[0]: -100.0 for out in plain}
    bias.update({17: 3.0, 250: 2.5, 999: -1.5})
    expected = hf_greedy(path, prompts, MAX_NEW, device=device, logit_bias=bias)
    assert expected != plain
    llm = LLM(str(path), device=device, **engine_args)
    biased = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            logit_bias=bias)
    unbiased = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # Biased and unbiased requests in one batch: each row gets only its own biases.
    outputs = llm.generate(prompts + prompts, [biased] * len(prompts) + [unbiased] * len(prompts))
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:len(prompts)] == expected
    assert got[len(prompts):] == plain


def test_logit_bias_matches_hf(tiny_checkpoint, hf_greedy) -> None:
    check_logit_bias_matches_hf(tiny_checkpoint("qwen3"), hf_greedy, "cpu")


def check_repetition_penalty_matches_hf(path, hf_greedy, device: str, **engine_args) -> None:
    """Engine greedy with repetition penalty equals HF's ``repetition_penalty`` (over prompt
    and generated tokens, as vLLM's), over several steps of the same requests (their prompt
    tokens stay on the device between steps); unpenalised requests in the same batch equal
    HF without."""
    prompts = mixed_prompts()[:8]
    plain = hf_greedy(path, prompts, MAX_NEW, device=device)
    expected = hf_greedy(path, prompts, MAX_NEW, device=device, repetition_penalty=1.8)
    assert expected != plain
    llm = LLM(str(path), device=device, **engine_args)
    penalised = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                               repetition_penalty=1.8)
    unpenalised = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts + prompts,
                           [penalised] * len(prompts) + [unpenalised] * len(prompts))
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:len(prompts)] == expected
    assert got[len(prompts):] == plain


def test_repetition_penalty_matches_hf(tiny_checkpoint, hf_greedy) -> None:
    check_repetition_penalty_matches_hf(tiny_checkpoint("qwen3"), hf_greedy, "cpu")
