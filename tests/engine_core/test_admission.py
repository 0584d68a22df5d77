"""What the engine admits: every request it accepts can finish. A request that needs more KV
than the whole cache is refused (it used to preempt itself forever, holding up the queue),
and a configuration whose step budget cannot hold one unchunked context does not start."""

from __future__ import annotations

import pytest

from engine_core import LLM, SamplingParams
from engine_core.errors import ConfigError, InvalidRequestError

BLOCK = 16


def test_a_request_must_fit_the_whole_kv_cache(tiny_checkpoint) -> None:
    # 4 blocks of 16: 64 tokens of KV, a quarter of max_model_len.
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", max_model_len=256,
              num_gpu_blocks_override=4, block_size=BLOCK)
    prompt = list(range(1, 41))
    with pytest.raises(InvalidRequestError, match="KV cache holds 64 tokens") as info:
        llm.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="KV cache holds 64") as info:
        llm.generate([list(range(1, 70))], SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"
    # What fits runs, beside a second request, and without max_tokens it stops at the cache.
    out = llm.generate([prompt, [5, 6, 7, 8, 9]],
                       [SamplingParams(max_tokens=24, ignore_eos=True),
                        SamplingParams(max_tokens=8, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in out] == [24, 8]
    (unbounded,) = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(unbounded.outputs[0].token_ids) == 64 - len(prompt)
    manager = llm.engine.kv_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_unchunked_prefill_needs_a_step_budget_of_one_context(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        LLM(path, device="cpu", max_model_len=256, enable_chunked_prefill=False,
            max_num_batched_tokens=32, num_gpu_blocks_override=32)
    llm = LLM(path, device="cpu", max_model_len=256, enable_chunked_prefill=False,
              max_num_batched_tokens=256, num_gpu_blocks_override=32)
    out = llm.generate([list(range(1, 41)), [5, 6, 7]], SamplingParams(max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
