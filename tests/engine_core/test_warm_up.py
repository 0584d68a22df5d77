"""Startup warm-up: the scripted steps stay inside any engine's limits and leave no runner
state (CPU); on CUDA (`gpu`) a varied workload after startup compiles no Triton kernel."""

from __future__ import annotations

import itertools
import random

import pytest

from engine_core import LLM, SamplingParams
from engine_core.kernels.jit_variants import compiled_variants
from engine_core.worker.warm_up import WARM_UP_PREFIX, WarmUpLimits, warm_up_steps


def _check_plan(limits: WarmUpLimits) -> list:
    steps = warm_up_steps(limits)
    computed: dict[str, int] = {}
    blocks: dict[str, list[int]] = {}
    for step in steps:
        assert len(step.num_scheduled_tokens) <= limits.max_num_seqs
        assert step.total_num_scheduled_tokens == sum(step.num_scheduled_tokens.values())
        assert step.total_num_scheduled_tokens <= limits.max_num_batched_tokens
        for new in step.scheduled_new_reqs:
            assert new.request_id.startswith(WARM_UP_PREFIX) and new.request_id not in computed
            assert len(new.token_ids) == new.num_prompt_tokens == step.num_scheduled_tokens[
                new.request_id]
            computed[new.request_id] = step.num_scheduled_tokens[new.request_id]
            blocks[new.request_id] = list(new.block_ids)
        for cached in step.scheduled_cached_reqs:
            assert cached.num_computed_tokens == computed[cached.request_id]
            computed[cached.request_id] += step.num_scheduled_tokens[cached.request_id]
            blocks[cached.request_id] += cached.new_block_ids
        for request_id, tokens in computed.items():
            assert tokens <= limits.max_model_len
            assert len(blocks[request_id]) * limits.block_size >= tokens
    every_block = [b for ids in blocks.values() for b in ids]
    assert len(every_block) == len(set(every_block))
    assert all(0 <= b < limits.num_blocks for b in every_block)
    if steps:
        assert steps[-1].is_empty and steps[-1].finished_req_ids == set(computed)
    return steps


def test_plan_covers_a_multi_sequence_prefill_then_a_mixed_step() -> None:
    steps = _check_plan(WarmUpLimits(16, 1000, 256, 8192, 4096))
    first, mixed, _ = steps
    assert len(first.scheduled_new_reqs) == 2
    assert max(len(r.token_ids) for r in first.scheduled_new_reqs) == 17  # crosses a block
    assert any(r.sampling_params.temperature > 0 for r in first.scheduled_new_reqs)
    assert mixed.scheduled_cached_reqs and mixed.scheduled_new_reqs  # decodes beside a prefill
    assert all(mixed.num_scheduled_tokens[c.request_id] == 1
               for c in mixed.scheduled_cached_reqs)


@pytest.mark.parametrize("block_size,num_blocks,seqs,tokens,model_len", [
    (1, 100, 1, 1, 2), (1, 100, 1, 2, 3), (4, 100, 2, 3, 8), (4, 2, 256, 8192, 64),
    (16, 1, 256, 8192, 64), (16, 3, 3, 5, 4), (8, 100, 2, 20, 64), (16, 100, 256, 16, 17),
])
def test_plan_respects_small_limits(block_size, num_blocks, seqs, tokens, model_len) -> None:
    _check_plan(WarmUpLimits(block_size, num_blocks, seqs, tokens, model_len))


def test_engine_leaves_no_warm_up_state(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.requests == {}
    assert llm.engine.kv_manager.block_pool.num_free_blocks == llm.engine.num_blocks
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def _varied_prompts(rng: random.Random, count: int, shared: list[int]) -> list[list[int]]:
    prompts = []
    for i in range(count):
        own = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 70))]
        prompts.append(shared + own if i % 3 == 0 else own)
    return prompts


def _varied_params(rng: random.Random, index: int) -> SamplingParams:
    max_tokens = rng.randint(1, 12)
    kind = index % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_p=0.9, top_k=10, seed=index,
                              max_tokens=max_tokens, ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2,
                              ignore_eos=True)
    return SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=max_tokens,
                          ignore_eos=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varied_workload_compiles_nothing_after_startup(tiny_checkpoint, dtype) -> None:
    """Batches of 1..70 sequences (the decode split count follows the batch size), chunked
    and whole prompts of 1..70 tokens, prefix hits, greedy / sampled / logprobs / penalties:
    every kernel variant they need was compiled before the engine took its first request."""
    llm = LLM(str(tiny_checkpoint("qwen3")), device="cuda", dtype=dtype, max_num_seqs=80,
              max_num_batched_tokens=128, gpu_memory_utilization=0.25)
    before = compiled_variants()
    assert before, "the engine compiled no Triton kernel: is the Triton backend in use?"
    rng = random.Random(5)
    shared = [rng.randrange(1, 1000) for _ in range(40)]
    counter = itertools.count()
    for batch in (1, 2, 3, 5, 9, 17, 40, 50, 70, 1):
        prompts = _varied_prompts(rng, batch, shared)
        params = [_varied_params(rng, next(counter)) for _ in prompts]
        outputs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    after = compiled_variants()
    assert after == before, {k: (before.get(k, 0), v) for k, v in after.items()
                             if before.get(k, 0) != v}
