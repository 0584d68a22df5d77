"""KV cache manager: prefix hits, slot allocation, all-or-nothing failure, caching, freeing."""

from __future__ import annotations

import random

import pytest

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool
from engine_core.sched.kv_cache_manager import KVCacheManager

BLOCK = 4


def make_manager(num_blocks: int, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching), BLOCK, BlockHasher(BLOCK),
                          enable_caching)


def make_request(token_ids: list[int], request_id: str) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(token_ids),
                   sampling_params=SamplingParams())


def prefill(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Look up the prefix cache and allocate the whole rest of the prompt in one go, as one
    scheduling pass (``end_pass``: the blocks it registered may be hit from the next)."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    manager.end_pass()
    return new_ids


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (pool.num_free_blocks, [b.block_id for b in pool.free_block_queue],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks], dict(pool.cached_blocks))


def test_first_allocation_and_block_ids() -> None:
    manager = make_manager(8)
    request = make_request(list(range(10)), "a")
    assert manager.get_computed_blocks(request) == ([], 0)
    new_ids = manager.allocate_slots(request, 10)
    assert new_ids == [0, 1, 2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_blocks_of("a") == 3
    assert manager.num_free_blocks == 5 and manager.num_total_blocks == 8
    assert manager.usage == pytest.approx(3 / 8)
    # Two full blocks are registered; the partial third is not.
    assert manager.block_pool.num_cached_blocks == 2
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2) == []  # still fits in block 2
    assert manager.get_block_ids("a") == [0, 1, 2]
    manager.check_integrity()


def test_prefix_hit_on_repeated_prompt() -> None:
    manager = make_manager(8)
    prompt = list(range(10))
    first = make_request(prompt, "a")
    prefill(manager, first)
    manager.free(first)
    second = make_request(prompt, "b")
    hits, num_tokens = manager.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1] and num_tokens == 8
    assert all(b.ref_cnt == 0 for b in hits)  # looked up, not yet touched
    queries = manager.prefix_cache_queries  # counted when a request is admitted
    # Block 2 held only a partial block, so it went to the free queue's front.
    assert manager.allocate_slots(second, 2, hits) == [2]
    assert manager.prefix_cache_queries - queries == 10 and manager.prefix_cache_hits == 8
    assert manager.get_block_ids("b") == [0, 1, 2]
    manager.check_integrity()


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    manager = make_manager(8)
    prompt = list(range(2 * BLOCK))
    first = make_request(prompt, "a")
    prefill(manager, first)
    manager.free(first)
    hits, num_tokens = manager.get_computed_blocks(make_request(prompt, "b"))
    assert len(hits) == 1 and num_tokens == BLOCK
    hits, num_tokens = manager.get_computed_blocks(make_request(prompt + [99], "c"))
    assert len(hits) == 2 and num_tokens == 2 * BLOCK


def test_allocation_failure_changes_nothing() -> None:
    manager = make_manager(4)
    first = make_request(list(range(8)), "a")
    prefill(manager, first)
    manager.free(first)  # blocks 0, 1 are free but hold cached content
    other = make_request([50, 51], "x")
    prefill(manager, other)
    second = make_request(list(range(16)), "b")
    hits, num_tokens = manager.get_computed_blocks(second)
    assert len(hits) == 2 and num_tokens == 8
    # 2 new blocks + 2 evictable hits > 3 free blocks: must refuse without touching.
    before = snapshot(manager)
    assert manager.allocate_slots(second, 8, hits) is None
    assert snapshot(manager) == before
    assert manager.num_blocks_of("b") == 0
    manager.check_integrity()
    manager.free(other)
    assert manager.allocate_slots(second, 8, hits) is not None
    assert manager.get_block_ids("b")[:2] == [0, 1]
    assert manager.num_free_blocks == 0
    manager.check_integrity()


def test_running_request_failure_changes_nothing() -> None:
    manager = make_manager(2)
    request = make_request(list(range(8)), "a")
    prefill(manager, request)
    request.append_token(8)
    before = snapshot(manager)
    assert manager.allocate_slots(request, 1) is None
    assert snapshot(manager) == before and manager.num_blocks_of("a") == 2


def test_two_requests_share_a_prefix() -> None:
    manager = make_manager(8)
    shared = list(range(8))
    first = make_request(shared + [100, 101], "a")
    prefill(manager, first)
    second = make_request(shared + [200, 201, 202], "b")
    hits, _ = manager.get_computed_blocks(second)
    assert len(hits) == 2 and all(b.ref_cnt == 1 for b in hits)
    free_before = manager.num_free_blocks
    assert manager.allocate_slots(second, 3, hits) == [3]
    assert manager.num_free_blocks == free_before - 1  # in-use hits cost nothing
    assert [b.ref_cnt for b in hits] == [2, 2]
    manager.check_integrity()
    manager.free(first)
    assert [b.ref_cnt for b in hits] == [1, 1]
    manager.check_integrity()
    manager.free(second)
    assert manager.num_free_blocks == 8
    manager.check_integrity()


def test_free_is_idempotent_and_reverse_ordered() -> None:
    manager = make_manager(8)
    request = make_request(list(range(12)), "a")
    prefill(manager, request)
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == 8 and manager.num_blocks_of("a") == 0
    assert [b.block_id for b in manager.block_pool.free_block_queue][-3:] == [2, 1, 0]
    manager.check_integrity()


def test_output_blocks_are_cached_as_they_fill() -> None:
    manager = make_manager(8)
    request = make_request([1, 2, 3, 4, 5, 6], "a")
    prefill(manager, request)
    assert manager.block_pool.num_cached_blocks == 1
    for token in (7, 8):
        request.append_token(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    # Counting the last sampled token (its KV is written this step) fills block 1.
    assert manager.block_pool.num_cached_blocks == 2
    expected = BlockHasher(BLOCK).hash_tokens(request.token_ids)
    assert request.block_hashes == expected
    assert manager.block_pool.get_cached_block(expected[1]).block_id == 1


def test_external_tokens_cached_only_after_load() -> None:
    manager = make_manager(8)
    prompt = list(range(13))
    request = make_request(prompt, "d")
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 0
    # Decode side: 12 tokens come from the prefill worker, the last one is computed here.
    assert manager.allocate_slots(request, 0, hits, num_external_tokens=12) == [0, 1, 2]
    assert manager.block_pool.num_cached_blocks == 0
    probe = make_request(prompt, "probe")
    assert manager.get_computed_blocks(probe) == ([], 0)
    # The transfer lands.
    request.num_computed_tokens = 12
    manager.cache_blocks(request, 12)
    assert manager.block_pool.num_cached_blocks == 3
    assert manager.allocate_slots(request, 1) == [3]
    hits, num_hit_tokens = manager.get_computed_blocks(make_request(prompt, "p2"))
    assert num_hit_tokens == 12
    manager.check_integrity()


def test_external_range_after_local_hits() -> None:
    manager = make_manager(8)
    shared = list(range(8))
    warm = make_request(shared, "warm")
    prefill(manager, warm)
    manager.free(warm)
    request = make_request(shared + list(range(50, 59)), "d")  # 17 tokens
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8
    new_ids = manager.allocate_slots(request, 0, hits, num_external_tokens=8)
    assert new_ids is not None and len(new_ids) == 2 and manager.num_blocks_of("d") == 4
    assert manager.block_pool.num_cached_blocks == 2  # only the local hits
    # A later call whose num_computed_tokens includes the landed tokens caches them.
    request.num_computed_tokens = 16
    assert len(manager.allocate_slots(request, 1)) == 1
    assert manager.block_pool.num_cached_blocks == 4
    manager.check_integrity()


def test_stale_hits_are_rejected() -> None:
    manager = make_manager(2)
    prompt = list(range(8))
    first = make_request(prompt, "a")
    prefill(manager, first)
    manager.free(first)
    request = make_request(prompt + [9], "b")
    hits, _ = manager.get_computed_blocks(request)
    assert len(hits) == 2
    thief = make_request([70] * 8, "t")
    prefill(manager, thief)  # evicts the hits
    manager.free(thief)
    with pytest.raises(ValueError, match="evicted"):
        manager.allocate_slots(request, 1, hits)
    manager.check_integrity()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    manager = make_manager(8)
    request = make_request(list(range(8)), "a")
    prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    assert manager.block_pool.num_cached_blocks == 2
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request(list(range(8)), "b")) == ([], 0)
    manager.check_integrity()


def test_caching_disabled() -> None:
    manager = make_manager(8, enable_caching=False)
    prompt = list(range(12))
    first = make_request(prompt, "a")
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request(prompt, "b")) == ([], 0)
    assert manager.prefix_cache_queries == 0 and manager.prefix_cache_hits == 0
    assert manager.block_pool.num_cached_blocks == 0
    manager.check_integrity()


def test_mismatched_construction_is_rejected() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4, True), 8, BlockHasher(BLOCK), True)
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4, False), BLOCK, BlockHasher(BLOCK), True)


def check_shared_blocks_are_cached(manager: KVCacheManager) -> None:
    for block in manager.block_pool.blocks:
        assert block.ref_cnt <= 1 or block.block_hash is not None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(seed: int) -> None:
    """Random admit/chunk/decode/remote-load/free; a simulated cache checks every hit's content."""
    rng = random.Random(seed)
    manager = make_manager(48)
    # What each block's slots hold, written as tokens are "computed" into them.
    content: dict[int, list[int | None]] = {i: [None] * BLOCK for i in range(48)}
    families = [[rng.randrange(30) for _ in range(40)] for _ in range(4)]
    live: dict[str, Request] = {}
    pending_external: dict[str, int] = {}
    counter = 0
    computed_this_pass: set[int] = set()  # blocks the step of the current pass writes

    def write(request: Request, start: int, end: int, computed: bool = True) -> None:
        blocks = manager.get_block_ids(request.request_id)
        for pos in range(start, end):
            content[blocks[pos // BLOCK]][pos % BLOCK] = request.token_ids[pos]
            if computed:
                computed_this_pass.add(blocks[pos // BLOCK])

    for op in range(3000):
        if rng.random() < 0.3:
            manager.end_pass()
            computed_this_pass.clear()
        roll = rng.random()
        if roll < 0.25 and len(live) < 10:
            counter += 1
            tokens = rng.choice(families)[:rng.randrange(41)]
            tokens = tokens + [rng.randrange(30) for _ in range(rng.randrange(1, 10))]
            request = make_request(tokens, f"r{counter}")
            hits, num_hit = manager.get_computed_blocks(request)
            for index, block in enumerate(hits):
                assert content[block.block_id] == tokens[index * BLOCK:(index + 1) * BLOCK]
                assert block.block_id not in computed_this_pass
            remaining = len(tokens) - num_hit
            if remaining > 1 and rng.random() < 0.25:
                external = rng.randrange(1, remaining)
                if manager.allocate_slots(request, 0, hits, external) is None:
                    continue
                request.num_computed_tokens = num_hit
                pending_external[request.request_id] = external
            else:
                chunk = min(remaining, rng.randrange(1, 24))
                if manager.allocate_slots(request, chunk, hits) is None:
                    assert manager.num_blocks_of(request.request_id) == 0
                    continue
                write(request, num_hit, num_hit + chunk)
                request.num_computed_tokens = num_hit + chunk
            live[request.request_id] = request
        elif roll < 0.8 and live:
            request = live[rng.choice(sorted(live))]
            external = pending_external.pop(request.request_id, None)
            if external is not None:  # the remote load lands
                start = request.num_computed_tokens
                write(request, start, start + external, computed=False)
                request.num_computed_tokens += external
                manager.cache_blocks(request, request.num_computed_tokens)
                continue
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(rng.randrange(30))
            num_new = min(request.num_tokens - request.num_computed_tokens, rng.randrange(1, 16))
            if manager.allocate_slots(request, num_new) is None:
                continue
            write(request, request.num_computed_tokens, request.num_computed_tokens + num_new)
            request.num_computed_tokens += num_new
            assert manager.num_blocks_of(request.request_id) * BLOCK >= request.num_computed_tokens
        elif live:
            request = live.pop(rng.choice(sorted(live)))
            pending_external.pop(request.request_id, None)
            manager.free(request)
            if rng.random() < 0.1:
                manager.free(request)
        if op % 20 == 0:
            manager.check_integrity()
            check_shared_blocks_are_cached(manager)

    assert manager.prefix_cache_hits > 0
    for request in live.values():
        manager.free(request)
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.reset_prefix_cache() is True


def test_prefix_counters_count_a_retried_admission_once() -> None:
    """A waiting request whose allocation fails is looked up again next step: one count."""
    manager = make_manager(6)
    prompt = list(range(12))
    first = make_request(prompt, "a")
    prefill(manager, first)
    manager.free(first)  # 3 cached free blocks at the back of the free queue
    blocker = make_request(list(range(100, 112)), "blocker")
    assert manager.allocate_slots(blocker, 12) is not None  # the 3 never-used blocks
    queries, hits_before = manager.prefix_cache_queries, manager.prefix_cache_hits
    second = make_request(prompt + [99] * 8, "b")
    for _ in range(3):  # three scheduling attempts, each failing for lack of blocks
        hits, _ = manager.get_computed_blocks(second)
        assert manager.allocate_slots(second, 20 - len(hits) * 4, hits) is None
    assert manager.prefix_cache_queries == queries and manager.prefix_cache_hits == hits_before
    manager.free(blocker)
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 12
    assert manager.allocate_slots(second, 20 - num_hit, hits) is not None
    assert manager.prefix_cache_queries == queries + 20
    assert manager.prefix_cache_hits == hits_before + num_hit
    manager.check_integrity()


def test_blocks_registered_in_a_pass_are_not_hit_in_the_same_pass() -> None:
    """Their KV is written by the step this pass schedules: a request admitted in the same
    pass must compute them itself (the fused decode kernel would read them while another
    program of its launch writes them). From the next pass on they are hits."""
    manager = make_manager(16)
    prompt = list(range(9))
    first = make_request(prompt, "a")
    hits, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, 9, hits) is not None
    first.num_computed_tokens = 9
    same_pass = make_request(prompt + [99], "b")
    assert manager.get_computed_blocks(same_pass) == ([], 0)
    manager.end_pass()
    next_pass = make_request(prompt + [98], "c")
    hits, num_tokens = manager.get_computed_blocks(next_pass)
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[:2] and num_tokens == 8


def test_a_same_pass_run_ends_at_the_first_new_block() -> None:
    """Blocks cached by an earlier pass still hit; the run stops at the first block this
    pass registered."""
    manager = make_manager(16)
    head = make_request(list(range(4)) + [50], "head")
    prefill(manager, head)  # its own pass: block 0 (tokens 0-3) cached
    longer = make_request(list(range(13)), "longer")
    hits, num_hit = manager.get_computed_blocks(longer)
    assert num_hit == 4
    assert manager.allocate_slots(longer, 13 - num_hit, hits) is not None  # blocks 1, 2 now
    longer.num_computed_tokens = 13
    follower = make_request(list(range(13)) + [7], "follower")
    hits, num_hit = manager.get_computed_blocks(follower)
    assert [b.block_id for b in hits] == manager.get_block_ids("head")[:1] and num_hit == 4
    manager.end_pass()
    assert manager.get_computed_blocks(follower)[1] == 12
    manager.check_integrity()
