"""The pool of KV cache blocks: ref counts, an LRU free queue, and the prefix-cache map.

A block with ``ref_cnt == 0`` sits in the free queue but may still hold cached content
(its ``block_hash``); it is reused by a prefix hit (``touch``) or evicted when
``get_new_blocks`` pops it. Every operation is O(1) per block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from engine_core.sched.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One paged-cache block; identity (not value) equality, so it can key sets and dicts."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Free-queue links; both None while the block is in use.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


def ensure_invariant(condition: bool, message: str) -> None:
    """Raise AssertionError even under ``python -O`` (where ``assert`` is stripped)."""
    if not condition:
        raise AssertionError(message)


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: O(1) pop, append, remove.

    The front holds the block to evict next; a freed block joins the back.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks front to back (eviction order)."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    @staticmethod
    def contains(block: KVCacheBlock) -> bool:
        """Whether ``block`` is linked into a free queue (O(1))."""
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        """Detach and return the front block; IndexError when empty."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue; ValueError if it is not queued."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the back (evicted last)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the front (reused first)."""
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVCacheBlock | None, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        assert anchor is not None and anchor.next_free is not None
        following = anchor.next_free
        block.prev_free, block.next_free = anchor, following
        anchor.next_free = block
        following.prev_free = block
        self.num_free += 1

    def check_integrity(self) -> set[int]:
        """Walk the list checking links and the count; returns the ids of queued blocks."""
        seen: set[int] = set()
        prev_block = self._head
        node = self._head.next_free
        while node is not self._tail:
            ensure_invariant(node is not None, "free queue is broken: a link is None before the tail")
            assert node is not None
            ensure_invariant(node.prev_free is prev_block,
                    f"free queue: block {node.block_id} has an inconsistent prev link")
            ensure_invariant(node.block_id not in seen,
                    f"free queue: block {node.block_id} appears twice (cycle)")
            ensure_invariant(len(seen) <= self.num_free, "free queue is longer than num_free")
            seen.add(node.block_id)
            prev_block, node = node, node.next_free
        ensure_invariant(self._tail.prev_free is prev_block, "free queue: tail's prev link is stale")
        ensure_invariant(len(seen) == self.num_free,
                f"free queue holds {len(seen)} blocks but num_free is {self.num_free}")
        return seen


class BlockPool:
    """All blocks of one KV cache, their ref counts, and the hash -> block prefix map.

    A hash maps to at most one block: a second block with the same content is kept but
    not shared, and its ``block_hash`` stays None. So a block has a hash exactly when
    the map points back at it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.enable_caching = enable_caching
        # Told (block id, hash) when cached content is evicted for reuse: KV offload (set by
        # the KVCacheManager that owns a host tier) keeps it.
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including those that still hold evictable cached content."""
        return self.free_block_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self.cached_blocks)

    def usage(self) -> float:
        """Fraction of blocks in use; evictable cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached content."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        taken: list[KVCacheBlock] = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding this content, in use or evictable; None on a miss."""
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero become free.

        Cached blocks join the back in the given order (callers pass a request's blocks
        in reverse, so its tail is evicted before its head). Blocks without a hash hold
        nothing reusable and go to the front, so they are reused before any cached block
        is evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more times than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, in-use block under ``block_hash``; first registration wins."""
        if not self.enable_caching:
            return
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block.block_id} is free; only owned blocks can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash in self.cached_blocks:
            return  # duplicate content: keep the existing mapping, this copy stays private
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the pool."""
        queued = self.free_block_queue.check_integrity()
        for index, block in enumerate(self.blocks):
            ensure_invariant(block.block_id == index, f"block at index {index} has id {block.block_id}")
            ensure_invariant(block.ref_cnt >= 0, f"block {index} has ref_cnt {block.ref_cnt}")
            in_queue = index in queued
            ensure_invariant((block.ref_cnt > 0) != in_queue,
                    f"block {index}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue}")
            if not in_queue:
                ensure_invariant(block.prev_free is None and block.next_free is None,
                        f"block {index} is in use but still has free-queue links")
            if block.block_hash is not None:
                ensure_invariant(self.cached_blocks.get(block.block_hash) is block,
                        f"block {index} has a hash that the cache map does not point to it")
        for block_hash, block in self.cached_blocks.items():
            ensure_invariant(block.block_hash == block_hash,
                    f"cache map entry points to block {block.block_id} with another hash")
            ensure_invariant(0 <= block.block_id < self.num_blocks
                    and self.blocks[block.block_id] is block,
                    f"cache map points to foreign block {block.block_id}")
        ensure_invariant(self.enable_caching or not self.cached_blocks,
                "caching is disabled but the cache map is not empty")
