"""`gpu`: the engine on CUDA matches HF transformers (float32 exact, bfloat16 close)."""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, SamplingParams
from tests.engine_core.test_engine_vs_hf import VARIANTS, mixed_prompts
from tests.engine_core.test_logit_bias_vs_hf import (
    check_logit_bias_matches_hf,
    check_repetition_penalty_matches_hf,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each test's engine takes a share of the card; give it back before the next one."""
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", ["default", "all_chunked", "preemption",
                                     "preemption_kv_offload"])
def test_float32_greedy_matches_hf_on_cuda(tiny_checkpoint, hf_greedy, arch, variant):
    path = tiny_checkpoint(arch)
    prompts = mixed_prompts()
    expected = hf_greedy(path, prompts, 10, device="cuda", dtype=torch.float32)
    llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3,
              **VARIANTS[variant])
    assert llm.engine.attn_backend.name == "triton", "the fast path must serve CUDA"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    manager = llm.engine.kv_manager
    assert manager.num_free_blocks == manager.num_total_blocks


@pytest.mark.parametrize(("split_k_mlp", "max_num_seqs"),
                         [("auto", 256), ("on", 2), ("on", 6), ("off", 6)],
                         ids=["default", "split-k-1-2-rows", "split-k-3-6-rows", "plain-mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_close_to_hf_on_cuda(tiny_checkpoint, hf_greedy, arch, split_k_mlp,
                                      max_num_seqs):
    """bf16 greedy near HF; small batches cover the decode MLP split-K (one launch up to two
    rows, the split-K GEMV beyond, float32 atomics) and the plain GEMVs."""
    path = tiny_checkpoint(arch)
    prompts = mixed_prompts()
    expected = hf_greedy(path, prompts, 16, device="cuda", dtype=torch.bfloat16)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              split_k_mlp=split_k_mlp, max_num_seqs=max_num_seqs)
    assert llm.engine.attn_backend.name == "triton", "the fast path must serve CUDA"
    if split_k_mlp != "auto":
        layers = llm.engine.model.model.layers
        assert all(layer.mlp.split_k == (split_k_mlp == "on") for layer in layers)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal >= len(prompts) * 3 // 4, f"only {equal}/{len(prompts)} prompts equal"
    # Random tiny weights give flat logits, so bf16 rounding can flip near-ties. Every
    # divergence must be such a tie: under fp32 logits of the shared prefix, the two
    # candidate tokens differ by less than bf16 noise.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda()
    for prompt, g, e in zip(prompts, got, expected):
        if g == e:
            continue
        k = next(i for i, (a, b) in enumerate(zip(g, e)) if a != b)
        ids = torch.tensor([prompt + e[:k]], device="cuda")
        with torch.no_grad():
            logits = reference(ids).logits[0, -1].float()
        gap = (logits[e[k]] - logits[g[k]]).abs().item()
        spread = (logits.max() - logits.min()).item()
        assert gap < 0.02 * spread, f"divergence at step {k} is not a near-tie ({gap=:.4f})"


def test_float32_logit_bias_matches_hf_on_cuda(tiny_checkpoint, hf_greedy):
    """The sampler's bias pass (an index_put on the device) on CUDA, in a mixed batch."""
    check_logit_bias_matches_hf(tiny_checkpoint("qwen3"), hf_greedy, "cuda", dtype="float32",
                                gpu_memory_utilization=0.3)


def test_float32_repetition_penalty_matches_hf_on_cuda(tiny_checkpoint, hf_greedy):
    """Penalties on CUDA: each request's prompt tokens reach the device once (pinned
    staging), the batch's concatenated for the mask."""
    check_repetition_penalty_matches_hf(tiny_checkpoint("qwen3"), hf_greedy, "cuda",
                                        dtype="float32", gpu_memory_utilization=0.3)
