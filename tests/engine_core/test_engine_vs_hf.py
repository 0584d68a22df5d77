"""Greedy output of the engine equals HF transformers `generate`, whatever the schedule.

Every variant (prefix caching on/off, shared prefixes hitting the cache, every prompt
chunked, preemption, block sizes 16 and 32) runs the same 16 prompts of mixed lengths in
one batch and must give token-identical outputs.
"""

from __future__ import annotations

import random

import pytest

from engine_core import LLM, SamplingParams

MAX_NEW = 10


def mixed_prompts(seed: int = 7) -> list[list[int]]:
    """16 prompts: 1 token, around block edges, several blocks, a few hundred, shared prefixes."""
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 33, 48, 64, 95, 130, 257]
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    for tail in (1, 9, 24, 70):
        prompts.append(shared + [rng.randrange(3, 1000) for _ in range(tail)])
    return prompts


def run_engine(path, prompts, **engine_args):
    llm = LLM(str(path), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outputs]


def assert_engine_idle(llm: LLM) -> None:
    """Every block is free again and the pool's invariants hold."""
    manager = llm.engine.kv_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks
    assert not llm.engine.has_work()


VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "all_chunked": {"max_num_batched_tokens": 16},
    "block_size_32": {"block_size": 32},
    "preemption": {"num_gpu_blocks_override": 26, "max_num_batched_tokens": 64},
    "preemption_bs32": {"num_gpu_blocks_override": 10, "block_size": 32, "max_num_batched_tokens": 64},
    "one_seq_at_a_time": {"max_num_seqs": 1},
    # Every variant above runs with async scheduling (the default); these step one at a time.
    "sync_scheduling": {"async_scheduling": False},
    "sync_preemption": {"async_scheduling": False, "num_gpu_blocks_override": 26,
                        "max_num_batched_tokens": 64},
    # A tight device cache whose evicted blocks go to host memory (KV offload).
    "preemption_kv_offload": {"num_gpu_blocks_override": 26, "max_num_batched_tokens": 64,
                              "kv_offloading_size": 0.01},
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(tiny_checkpoint, hf_greedy, arch, variant):
    path = tiny_checkpoint(arch)
    prompts = mixed_prompts()
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm, got = run_engine(path, prompts, **VARIANTS[variant])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) differs: {g} != {e}"
    if variant.startswith("preemption"):
        assert llm.engine.get_stats().num_preemptions > 0
    if variant.endswith("kv_offload"):
        assert llm.engine.get_stats().kv_offload_stored_blocks > 0
    assert_engine_idle(llm)


def test_qwen2_matches_hf(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("qwen2")
    prompts = mixed_prompts(seed=11)[:8]
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm, got = run_engine(path, prompts, max_num_batched_tokens=32)
    assert got == expected
    assert_engine_idle(llm)


def test_shared_prefixes_hit_cache_and_match(tiny_checkpoint, hf_greedy):
    """Second submission of the same batch is served mostly from the prefix cache."""
    path = tiny_checkpoint("llama")
    prompts = mixed_prompts()
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm, first = run_engine(path, prompts)
    stats_before = llm.engine.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats_after = llm.engine.get_stats()
    assert first == expected and second == expected
    assert stats_after.prefix_cache_hits - stats_before.prefix_cache_hits > 500
    assert_engine_idle(llm)


def test_repeated_prompt_computes_only_last_partial_block(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), block_size=16)
    prompt = list(range(100, 100 + 53))  # 3 full blocks + 5 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0]
    computed_before = llm.engine.get_stats().num_computed_prompt_tokens_total
    second_request = llm.generate([prompt], params)[0]
    second = second_request.outputs[0]
    stats = llm.engine.get_stats()
    assert second.token_ids == first.token_ids
    assert stats.num_computed_prompt_tokens_total - computed_before == 5
    assert second_request.num_cached_tokens == 48
    assert_engine_idle(llm)


def test_prompt_of_exact_blocks_recomputes_one_block(tiny_checkpoint):
    """A fully cached prompt still computes its last block to get logits."""
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), block_size=16)
    prompt = list(range(200, 232))  # exactly 2 blocks
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0]
    before = llm.engine.get_stats().num_computed_prompt_tokens_total
    second = llm.generate([prompt], params)[0].outputs[0]
    assert second.token_ids == first.token_ids
    assert llm.engine.get_stats().num_computed_prompt_tokens_total - before == 16
    assert_engine_idle(llm)
