"""Maps requests to KV cache blocks: prefix lookup, slot allocation, caching, freeing.

The scheduler asks ``get_computed_blocks`` once for a new request, then calls
``allocate_slots`` each step; a ``None`` answer means "does not fit now" and leaves
every count as it was, so the scheduler may preempt or try the next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine_core.request import Request
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool, KVCacheBlock, ensure_invariant


class KVCacheManager:
    """Owns the request -> blocks table over one ``BlockPool``, with prefix-cache counters."""

    def __init__(self, block_pool: BlockPool, block_size: int, hasher: BlockHasher,
                 enable_caching: bool) -> None:
        if hasher.block_size != block_size:
            raise ValueError(f"hasher block size {hasher.block_size} != block_size {block_size}")
        if enable_caching != block_pool.enable_caching:
            raise ValueError("KVCacheManager and BlockPool disagree on enable_caching")
        self.block_pool = block_pool
        self.block_size = block_size
        self.hasher = hasher
        self.enable_caching = enable_caching
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many of its leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0

    # -- counters and gauges -------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache (monotonic)."""
        return self._prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens found in the prefix cache (monotonic)."""
        return self._prefix_cache_hits

    # -- the scheduler's calls -----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached run of full blocks from the start, leaving >= 1 token to compute.

        The last token is always computed because its logits are needed to sample. The
        blocks are not touched here; ``allocate_slots`` takes them.
        """
        if not self.enable_caching:
            return [], 0
        self.hasher.update_request_hashes(request)
        max_blocks = max(request.num_tokens - 1, 0) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_external_tokens: int = 0) -> list[int] | None:
        """Give the request blocks for all its computed, hit, external and new tokens.

        Returns the ids of newly allocated blocks, or None (nothing changed) when the
        pool cannot supply them. Blocks that local compute fills are registered in the
        prefix cache now; blocks filled by a remote transfer wait for ``cache_blocks``.
        """
        if num_new_tokens < 0 or num_external_tokens < 0:
            raise ValueError("num_new_tokens and num_external_tokens must be >= 0")
        request_id = request.request_id
        owned = self._req_to_blocks.get(request_id, [])
        # Admission (no blocks, nothing computed) follows the prefix lookup: counted here,
        # once it succeeds, so a request retried after a failed allocation counts once.
        admitting = not owned and request.num_computed_tokens == 0
        if new_computed_blocks:
            if owned or request.num_computed_tokens:
                raise ValueError(f"request {request_id}: prefix hits are only accepted "
                                 "before it owns blocks or has computed tokens")
            self._check_hits_still_cached(request, new_computed_blocks)
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        local_end = request.num_computed_tokens + num_hit_tokens
        total_tokens = local_end + num_external_tokens + num_new_tokens
        num_required = -(-total_tokens // self.block_size)
        num_to_allocate = max(num_required - len(owned) - len(new_computed_blocks), 0)
        # A hit that sits in the free queue is no new block, but touching it takes it
        # out of what get_new_blocks may pop.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_to_allocate + num_evictable_hits > self.block_pool.num_free_blocks:
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            owned = list(new_computed_blocks)
            self._num_cached_blocks[request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        if owned or new_blocks:
            owned.extend(new_blocks)
            self._req_to_blocks[request_id] = owned

        # Caching stays a contiguous prefix: with an external range pending, stop at it;
        # blocks past it are registered once the load lands (cache_blocks or a later call
        # whose num_computed_tokens includes the loaded tokens).
        cache_end = local_end if num_external_tokens else local_end + num_new_tokens
        self._cache_up_to(request, cache_end)
        if admitting and self.enable_caching:
            # num_tokens == num_prompt_tokens for a fresh request; a resumed (preempted)
            # request may also hit on its own earlier output, so count what was looked up.
            self._prefix_cache_queries += request.num_tokens
            self._prefix_cache_hits += num_hit_tokens
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` (after a remote load)."""
        self._cache_up_to(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first so the head stays cached longer."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        # Nothing is owned, so no per-request cache pointer can outlive the reset.
        self._num_cached_blocks.clear()
        return True

    def check_integrity(self) -> None:
        """Pool invariants, plus: every block's ref count equals how many requests own it."""
        self.block_pool.check_integrity()
        owners: Counter[int] = Counter()
        for request_id, blocks in self._req_to_blocks.items():
            ensure_invariant(len({id(block) for block in blocks}) == len(blocks),
                    f"request {request_id} owns the same block twice")
            ensure_invariant(self._num_cached_blocks.get(request_id, 0) <= len(blocks),
                    f"request {request_id} has more cached blocks than blocks")
            owners.update(block.block_id for block in blocks)
        for block in self.block_pool.blocks:
            ensure_invariant(block.ref_cnt == owners.get(block.block_id, 0),
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                    f"{owners.get(block.block_id, 0)} owners")
        ensure_invariant(set(self._num_cached_blocks) <= set(self._req_to_blocks),
                "a cache pointer outlived its request's blocks")

    # -- internals -----------------------------------------------------------------------

    def _check_hits_still_cached(self, request: Request,
                                 hits: Sequence[KVCacheBlock]) -> None:
        """A hit evicted between lookup and allocation would silently serve wrong KV."""
        for index, block in enumerate(hits):
            if (index >= len(request.block_hashes)
                    or block.block_hash != request.block_hashes[index]):
                raise ValueError(f"request {request.request_id}: prefix-hit block "
                                 f"{block.block_id} was evicted after get_computed_blocks")

    def _cache_up_to(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering tokens [0, num_tokens)."""
        if not self.enable_caching:
            return
        blocks = self._req_to_blocks.get(request.request_id)
        if not blocks:
            return
        self.hasher.update_request_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for index in range(start, num_full):
            self.block_pool.cache_block(blocks[index], request.block_hashes[index])
        if num_full > start:
            self._num_cached_blocks[request.request_id] = num_full
