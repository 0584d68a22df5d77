"""KV offload (``--kv-offloading-size``): blocks the device evicts are kept in host memory and
prefix hits there are copied back; greedy output stays HF's token for token.

The host tier's rules (pending slots never served or reused, slots served this pass pinned,
a hash held once) are checked on their own, then the manager's copies, then the engine end
to end with a device cache small enough that every reuse of a prefix must come from host
memory.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.sched.host_tier import HostTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_host_tier_rules() -> None:
    tier = HostTier(2)
    a, b, c = b"a", b"b", b"c"
    slot_a = tier.store(a)
    assert slot_a is not None and tier.lookup(a) is None  # pending: not served
    assert tier.store(a) is None  # held already: no second copy
    slot_b = tier.store(b)
    assert tier.store(c) is None and tier.dropped_blocks == 1  # both pending: none reusable
    tier.landed([slot_a, slot_b])
    assert tier.lookup(a) == slot_a  # served, pinned for this pass, most recent
    slot_c = tier.store(c)
    assert slot_c == slot_b  # b was least recent and unpinned: reused
    tier.landed([slot_c])
    assert tier.store(b"d") == slot_c  # a is pinned (older, but served this pass): c goes
    tier.end_pass()
    tier.landed([slot_c])
    assert tier.store(b"e") == slot_a  # unpinned now, and least recent
    tier.check_integrity()


def test_host_tier_reuses_least_recent_unpinned() -> None:
    tier = HostTier(3)
    slots = {h: tier.store(h) for h in (b"x", b"y", b"z")}
    tier.landed(list(slots.values()))
    tier.end_pass()
    assert tier.lookup(b"x") == slots[b"x"]  # x pinned and most recent
    tier.end_pass()
    assert tier.store(b"w") == slots[b"y"]  # y is now least recent
    tier.clear()
    assert len(tier) == 0  # w's download is still in flight: forgotten, its slot held
    tier.check_integrity()
    tier.landed([slots[b"y"]])
    assert tier.lookup(b"w") is None and tier.store(b"v") is not None
    tier.check_integrity()


def _block_bytes(llm: LLM, block_id: int) -> torch.Tensor:
    """K and V of one block in every layer, as bytes."""
    return torch.stack([c[:, block_id].contiguous().view(torch.uint8).clone()
                        for c in llm.engine.kv_caches])


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prefixes_evicted_from_the_device_come_back_from_host(
        tiny_checkpoint, hf_greedy, async_scheduling: bool) -> None:
    path = tiny_checkpoint("qwen3")
    first = _prompts(1, 4, 70)    # 4 full blocks each (block 16), then a partial one
    others = _prompts(2, 6, 70)   # enough to evict every block of ``first`` from the device
    expected_first = hf_greedy(path, first, 6)
    llm = LLM(str(path), num_gpu_blocks_override=24, kv_offloading_size=0.01,
              max_num_seqs=4, async_scheduling=async_scheduling)
    tier = llm.engine.kv_manager.host_tier
    assert tier is not None
    assert [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)] == expected_first
    manager = llm.engine.kv_manager
    # The bytes of every cached block now, by hash: what host memory must give back.
    snapshot = {h: _block_bytes(llm, b.block_id)
                for h, b in manager.block_pool.cached_blocks.items()}
    assert [o.outputs[0].token_ids for o in llm.generate(others, GREEDY)] == hf_greedy(path, others, 6)
    assert not set(snapshot) & set(manager.block_pool.cached_blocks), "first's blocks stayed"
    assert tier.stored_blocks > 0, "the device evicted nothing: the test proves nothing"
    hits_before, loaded_before = manager.prefix_cache_hits, tier.loaded_blocks
    again = llm.generate(first, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected_first
    back = {h: b.block_id for h, b in manager.block_pool.cached_blocks.items() if h in snapshot}
    assert len(back) >= 4 * len(first)
    assert all(torch.equal(_block_bytes(llm, block), snapshot[h]) for h, block in back.items())
    # Each prompt's four full blocks came back from host memory (the device held none).
    assert tier.loaded_blocks - loaded_before == 4 * len(first)
    assert manager.prefix_cache_hits - hits_before == 4 * 16 * len(first)
    assert all(o.num_cached_tokens == 64 for o in again)
    manager.check_integrity()
    tier.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks
    stats = llm.engine.get_stats()
    assert stats.kv_offload_loaded_blocks == tier.loaded_blocks > 0
    assert stats.kv_offload_stored_blocks == tier.stored_blocks


def test_offload_with_preemption_and_shared_prefixes(tiny_checkpoint, hf_greedy) -> None:
    """A tight device cache (preemptions), shared prefixes, repeated rounds: every round's
    output equals HF's and the cache invariants hold throughout."""
    path = tiny_checkpoint("llama")
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
               for _ in range(6)] + _prompts(9, 4, 50)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(str(path), num_gpu_blocks_override=14, kv_offloading_size=0.01,
              max_num_batched_tokens=64)
    for round_ in range(3):
        order = list(range(len(prompts)))
        random.Random(round_).shuffle(order)
        got = llm.generate([prompts[i] for i in order], GREEDY)
        assert [o.outputs[0].token_ids for o in got] == [expected[i] for i in order], round_
        llm.engine.kv_manager.check_integrity()
    assert llm.engine.kv_manager.host_tier.loaded_blocks > 0
    assert llm.engine.get_stats().num_preemptions > 0


def test_offload_needs_prefix_caching_and_room(tiny_checkpoint) -> None:
    from engine_core.errors import ConfigError

    path = str(tiny_checkpoint("llama"))
    off = LLM(path, num_gpu_blocks_override=16, kv_offloading_size=0.01,
              enable_prefix_caching=False)
    assert off.engine.kv_manager.host_tier is None and off.engine.host_kv is None
    with pytest.raises(ConfigError, match="holds no block"):
        LLM(path, num_gpu_blocks_override=16, kv_offloading_size=1e-9)
    with pytest.raises(ConfigError):
        LLM(path, kv_offloading_size=-1)


@pytest.mark.gpu
def test_offload_on_cuda_is_byte_exact_and_hf_equal(tiny_checkpoint, hf_greedy) -> None:
    """On CUDA (graphs, async scheduling, pinned host memory, downloads landing later): the
    blocks that come back hold the bytes they held before eviction; output equals HF's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = tiny_checkpoint("qwen3")
    first, others = _prompts(1, 4, 70), _prompts(2, 6, 70)
    expected = hf_greedy(path, first, 6, device="cuda", dtype=torch.float32)
    llm = LLM(str(path), device="cuda", dtype="float32", num_gpu_blocks_override=24,
              kv_offloading_size=0.01, max_num_seqs=4)
    assert llm.engine.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)] == expected
    manager = llm.engine.kv_manager
    snapshot = {h: _block_bytes(llm, b.block_id).cpu()
                for h, b in manager.block_pool.cached_blocks.items()}
    llm.generate(others, GREEDY)
    torch.cuda.synchronize()
    llm.engine.host_kv.poll()
    assert [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)] == expected
    back = {h: b.block_id for h, b in manager.block_pool.cached_blocks.items() if h in snapshot}
    assert len(back) >= 4 * len(first)
    assert all(torch.equal(_block_bytes(llm, block).cpu(), snapshot[h])
               for h, block in back.items())
    manager.check_integrity()


@pytest.mark.parametrize("level", [1, 2])
def test_host_tier_outlives_sleep(tiny_checkpoint, hf_greedy, level: int) -> None:
    """Sleep drops the device cache. Level 1 (the same weights back) keeps the host tier:
    after waking, prefixes that were offloaded come back from host memory, byte for byte,
    and answer as HF. Level 2 reloads the weights, which may have changed, so the host tier
    goes too (tests/engine_core/test_sleep_mode.py checks it with a new checkpoint)."""
    path = tiny_checkpoint("qwen3")
    first, others = _prompts(3, 4, 70), _prompts(4, 6, 70)
    expected_first = hf_greedy(path, first, 6)
    llm = LLM(str(path), num_gpu_blocks_override=24, kv_offloading_size=0.01, max_num_seqs=4,
              enable_sleep_mode=True)
    manager, tier = llm.engine.kv_manager, llm.engine.kv_manager.host_tier
    assert [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)] == expected_first
    snapshot = {h: _block_bytes(llm, b.block_id)
                for h, b in manager.block_pool.cached_blocks.items()}
    llm.generate(others, GREEDY)  # pushes first's blocks out to the host tier
    llm.sleep(level)
    llm.wake_up()
    assert not manager.block_pool.cached_blocks, "sleep must drop the device's cached blocks"
    loaded_before = tier.loaded_blocks
    again = llm.generate(first, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected_first
    if level == 2:
        assert tier.loaded_blocks == loaded_before
        manager.check_integrity()
        return
    assert tier.loaded_blocks - loaded_before == 4 * len(first)
    back = {h: b.block_id for h, b in manager.block_pool.cached_blocks.items() if h in snapshot}
    assert len(back) == 4 * len(first)
    assert all(torch.equal(_block_bytes(llm, block), snapshot[h]) for h, block in back.items())
    manager.check_integrity()
    tier.check_integrity()
