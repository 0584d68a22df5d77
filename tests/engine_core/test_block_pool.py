"""Block pool: O(1) free queue, LRU eviction of cached blocks, ref counts, integrity."""

from __future__ import annotations

import pytest

from engine_core.sched.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def h(n: int) -> bytes:
    return n.to_bytes(4, "little")


def test_free_queue_order_and_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == queue.num_free == 5
    assert ids(queue) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # front
    queue.remove(blocks[4])  # back
    assert ids(queue) == [1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[4])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    assert queue.num_free == 3
    assert queue.check_integrity() == {1, 3, 4}
    with pytest.raises(ValueError):
        queue.remove(blocks[2])
    with pytest.raises(ValueError):
        queue.append(blocks[1])
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.check_integrity() == set()


def test_free_queue_integrity_detects_broken_links() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    blocks[2].prev_free = blocks[0]
    with pytest.raises(AssertionError, match="prev link"):
        queue.check_integrity()


def test_get_new_blocks_takes_from_front_and_sets_refs() -> None:
    pool = BlockPool(4, enable_caching=True)
    taken = pool.get_new_blocks(3)
    assert ids(taken) == [0, 1, 2]
    assert all(block.ref_cnt == 1 for block in taken)
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_lru_tail_of_freed_request_evicted_first() -> None:
    pool = BlockPool(6, enable_caching=True)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(3)
    for index, block in enumerate(first + second):
        pool.cache_block(block, h(index))
    pool.free_blocks(reversed(first))
    pool.free_blocks(reversed(second))
    pool.check_integrity()
    # Earliest-freed first; within a request, its tail before its head.
    assert ids(pool.free_block_queue) == [2, 1, 0, 5, 4, 3]
    evicted = pool.get_new_blocks(2)
    assert ids(evicted) == [2, 1]
    assert all(block.block_hash is None for block in evicted)
    assert pool.get_cached_block(h(2)) is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is first[0]
    pool.check_integrity()


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], h(0))
    pool.cache_block(blocks[1], h(1))
    pool.free_blocks(reversed(blocks))  # 3, 2 hold nothing; 1, 0 hold content
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


def test_touch_removes_from_free_queue_and_counts_refs() -> None:
    pool = BlockPool(3, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, h(7))
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(h(7))
    assert hit is block
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block not in list(pool.free_block_queue)
    pool.touch([hit])  # a second owner: no queue change
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.check_integrity()
    # The touched block survives allocation of everything else.
    assert block not in pool.get_new_blocks(2)
    assert pool.get_cached_block(h(7)) is block
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.free_blocks([block])


def test_cache_block_keeps_existing_mapping_for_duplicates() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None
    pool.cache_block(a, h(1))  # re-registering is a no-op
    with pytest.raises(ValueError):
        pool.cache_block(a, h(2))
    pool.free_blocks([a, b])
    with pytest.raises(ValueError):
        pool.cache_block(a, h(3))  # free blocks cannot be registered
    pool.check_integrity()


def test_caching_disabled_never_maps() -> None:
    pool = BlockPool(2, enable_caching=False)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, h(1))
    assert block.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    pool.free_blocks([block])
    pool.check_integrity()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], h(0))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(0)) is None
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)
    pool.check_integrity()


def test_integrity_detects_corruption() -> None:
    pool = BlockPool(3, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt = 0  # in use per the queue, but no reference
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_integrity()
    block.ref_cnt = 1
    pool.cache_block(block, h(1))
    block.block_hash = h(2)
    with pytest.raises(AssertionError):
        pool.check_integrity()
