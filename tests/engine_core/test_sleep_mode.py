"""Sleep mode: an idle engine frees its weights and KV cache and, woken, answers as before.

Level 1 restores the weights from a host copy, level 2 reloads them (checkpoint or the same
dummy draw); either way greedy output equals HF transformers' after the wake-up, the prefix
cache starts empty, and while asleep requests are refused (HTTP 503 in the server).
"""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.errors import EngineSleepingError, InvalidRequestError
from engine_core.messages import AddRequest
from tests.engine_core.test_engine_vs_hf import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an arena's views share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _weight_bytes(llm: LLM) -> int:
    return _held_bytes(llm.engine.model.parameters())


def _kv_bytes(llm: LLM) -> int:
    return _held_bytes(llm.engine.kv_caches)


def _param_sizes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_answers_as_hf(tiny_checkpoint, hf_greedy, level: int) -> None:
    """On CPU, where an arena's storage shrinks to nothing asleep (on CUDA its storage keeps
    its size over unmapped addresses: test_sleep_on_cuda_gives_the_memory_back reads the
    device's free memory instead)."""
    path = tiny_checkpoint("qwen3")
    prompts = mixed_prompts()[:6]
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), device="cpu", enable_sleep_mode=True, num_gpu_blocks_override=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.kv_manager.prefix_cache_hits == 0
    weights, kv = _weight_bytes(llm), _kv_bytes(llm)
    assert weights >= _param_sizes(llm) > 0 and kv > 0
    caches = list(llm.engine.kv_caches)

    llm.sleep(level)
    assert llm.engine.sleep_level == level
    assert _weight_bytes(llm) == 0 and _kv_bytes(llm) == 0
    with pytest.raises(EngineSleepingError):
        llm.generate(prompts[:1], GREEDY)
    llm.sleep(level)  # again: nothing to do

    llm.wake_up()
    assert llm.engine.sleep_level == 0
    assert _weight_bytes(llm) == weights and _kv_bytes(llm) == kv
    assert all(a is b for a, b in zip(llm.engine.kv_caches, caches, strict=True))
    queries = llm.engine.kv_manager.prefix_cache_queries
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    # The cache was dropped asleep: the same prompts found no cached block.
    assert llm.engine.kv_manager.prefix_cache_queries > queries
    assert llm.engine.kv_manager.prefix_cache_hits == 0
    manager = llm.engine.kv_manager
    assert manager.num_free_blocks == manager.num_total_blocks


def test_level_two_with_dummy_weights_draws_the_same_weights(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), load_format="dummy", enable_sleep_mode=True,
              num_gpu_blocks_override=32)
    model = llm.engine.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Every module's parameter objects (a tied embedding is one object in two modules).
    objects = [id(p) for m in model.modules() for p in m.parameters(recurse=False)]
    llm.sleep(2)
    llm.wake_up()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert [id(p) for m in model.modules() for p in m.parameters(recurse=False)] == objects


def test_level_one_keeps_its_host_copy_for_the_next_sleep(tiny_checkpoint, hf_greedy) -> None:
    """The first level-1 sleep lays the weights out in one host buffer; later level-1 sleeps
    (after a level-2 one too) copy into the same buffer, and every wake-up answers as HF."""
    path = tiny_checkpoint("qwen3")
    prompts = mixed_prompts()[:3]
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), enable_sleep_mode=True, num_gpu_blocks_override=32)
    weights = _param_sizes(llm)
    assert set(llm.sleep(1)) == {"kv_cache_s", "weights_s"}
    host = llm.engine._host_weights
    assert host is not None and host.nbytes >= weights
    llm.wake_up()
    for level in (2, 1):
        llm.sleep(level)
        assert set(llm.wake_up()) == {"weights_s", "kv_cache_s"}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine._host_weights is host


def test_sleep_needs_the_flag_an_idle_engine_and_a_valid_level(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama"))
    off = LLM(path, num_gpu_blocks_override=32)
    with pytest.raises(InvalidRequestError, match="--enable-sleep-mode"):
        off.sleep(1)
    llm = LLM(path, enable_sleep_mode=True, num_gpu_blocks_override=32)
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(3)
    token_ids = llm.tokenizer("a request in flight")["input_ids"]
    llm.engine.add_request(AddRequest("busy", token_ids, GREEDY.to_dict(), 0.0))
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.sleep(1)
    assert llm.engine.sleep_level == 0
    llm.engine.abort_requests(["busy"])
    while llm.engine.has_runnable():
        llm.engine.step()
    llm.sleep(1)
    assert llm.engine.sleep_level == 1


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_on_cuda_gives_the_memory_back(tiny_checkpoint, hf_greedy, level: int) -> None:
    """On CUDA with graphs: asleep, the device has at least the weights and the KV cache more
    free memory; woken, every parameter and cache is back at its address, the graphs captured
    at startup are the ones that run, and greedy output still equals HF's (twice: the second
    sleep reuses the first's host copy)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = tiny_checkpoint("qwen3")
    prompts = mixed_prompts()[:6]
    expected = hf_greedy(path, prompts, 8, device="cuda", dtype=torch.float32)
    llm = LLM(str(path), device="cuda", dtype="float32", enable_sleep_mode=True,
              gpu_memory_utilization=0.3)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "graphs must be captured for this test"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    kv = llm.engine.kv_arena.nbytes
    addresses = [t.data_ptr() for t in (*llm.engine.model.parameters(), *llm.engine.kv_caches)]
    replayed: list[int] = []
    replay = graphs.replay
    graphs.replay = lambda size, mixed: replayed.append(size) or replay(size, mixed)
    for _ in range(2):
        torch.cuda.synchronize()
        awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level)
        asleep = torch.cuda.mem_get_info()[0]
        assert asleep - awake >= weights + kv, (awake, asleep, weights, kv)
        llm.wake_up()
        assert llm.engine.runner.graphs is graphs
        assert [t.data_ptr() for t in (*llm.engine.model.parameters(),
                                       *llm.engine.kv_caches)] == addresses
        replayed.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        assert replayed, "the startup graphs did not run after waking"


def test_staged_wake_up_serves_once_both_are_back(tiny_checkpoint, hf_greedy) -> None:
    """vLLM's ``wake_up(tags=["weights"])`` then ``["kv_cache"]`` (e.g. to update weights
    while the cache's memory is still free): the first wakes only the weights and the engine
    keeps refusing requests; after the second it answers as HF. Tags were ignored before
    (the first call woke everything)."""
    path = tiny_checkpoint("qwen3")
    prompts = mixed_prompts()[:3]
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), device="cpu", enable_sleep_mode=True, num_gpu_blocks_override=32)
    weights, kv = _weight_bytes(llm), _kv_bytes(llm)
    llm.sleep(1)
    with pytest.raises(InvalidRequestError, match="tags"):
        llm.wake_up(["weights", "bogus"])
    assert set(llm.wake_up(["weights"])) == {"weights_s"}
    assert _weight_bytes(llm) == weights and _kv_bytes(llm) == 0
    assert llm.engine.sleep_level == 1
    with pytest.raises(EngineSleepingError):
        llm.generate(prompts[:1], GREEDY)
    assert llm.wake_up(["weights"]) == {}  # awake already: nothing to do
    assert set(llm.wake_up(["kv_cache"])) == {"kv_cache_s"}
    assert llm.engine.sleep_level == 0 and _kv_bytes(llm) == kv
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_level_two_wake_up_drops_host_kv_of_the_old_weights(tmp_path) -> None:
    """Level 2 reloads the checkpoint at wake-up, which may have changed meanwhile (vLLM's
    weight-update level): prefixes offloaded to host memory hold the old weights' KV and
    used to come back as prefix hits. Level 1 restores the same weights and keeps them."""
    import random

    from engine_core.demo_model import build_checkpoint
    from tests.conftest import TINY_SHAPES

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    rng = random.Random(3)
    first = [[rng.randrange(3, 1000) for _ in range(70)] for _ in range(4)]
    others = [[rng.randrange(3, 1000) for _ in range(70)] for _ in range(6)]
    path, new = tmp_path / "ckpt", tmp_path / "new"
    build_checkpoint(path, arch="qwen3", seed=1234, dtype="float32", **TINY_SHAPES["qwen3"])
    build_checkpoint(new, arch="qwen3", seed=999, dtype="float32", **TINY_SHAPES["qwen3"])
    llm = LLM(str(path), num_gpu_blocks_override=24, kv_offloading_size=0.01, max_num_seqs=4,
              enable_sleep_mode=True)
    tier = llm.engine.kv_manager.host_tier
    assert tier is not None

    def host_hits_of(prompts) -> tuple[int, list]:
        before = tier.loaded_blocks
        outputs = llm.generate(prompts, greedy)
        return tier.loaded_blocks - before, [[e.logprob for e in o.outputs[0].logprobs] for o in outputs]

    llm.generate(first, greedy)
    llm.generate(others, greedy)  # pushes first's prefixes out to host memory
    llm.sleep(1)
    llm.wake_up()
    hits, _ = host_hits_of(first)
    assert hits > 0  # level 1: the same weights, the host prefixes still serve
    llm.generate(others, greedy)
    llm.sleep(2)
    for weights in new.glob("*.safetensors"):  # the trainer writes the new weights
        (path / weights.name).write_bytes(weights.read_bytes())
    llm.wake_up()
    hits, got = host_hits_of(first)
    assert hits == 0
    fresh = LLM(str(new), num_gpu_blocks_override=24, max_num_seqs=4)
    want = [[e.logprob for e in o.outputs[0].logprobs] for o in fresh.generate(first, greedy)]
    assert got == want
