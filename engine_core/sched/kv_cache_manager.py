"""Maps requests to KV cache blocks: prefix lookup, slot allocation, caching, freeing.

The scheduler asks ``get_computed_blocks`` once for a new request, then calls
``allocate_slots`` each step; a ``None`` answer means "does not fit now" and leaves
every count as it was, so the scheduler may preempt or try the next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_core.request import Request
from engine_core.sched.block_hash import BlockHash, BlockHasher
from engine_core.sched.block_pool import BlockPool, KVCacheBlock, ensure_invariant
from engine_core.sched.host_tier import HostTier


@dataclass
class HostCopies:
    """One scheduling pass's KV offload copies, executed in this order before its step:
    device blocks down to host slots (content they held before this pass reused them), then
    host slots up to device blocks (prefix hits found in host memory)."""

    offload_blocks: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    onload_slots: list[int] = field(default_factory=list)
    onload_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload_blocks or self.onload_blocks)


class KVCacheManager:
    """Owns the request -> blocks table over one ``BlockPool``, with prefix-cache counters."""

    def __init__(self, block_pool: BlockPool, block_size: int, hasher: BlockHasher,
                 enable_caching: bool, host_tier: HostTier | None = None) -> None:
        if hasher.block_size != block_size:
            raise ValueError(f"hasher block size {hasher.block_size} != block_size {block_size}")
        if enable_caching != block_pool.enable_caching:
            raise ValueError("KVCacheManager and BlockPool disagree on enable_caching")
        self.block_pool = block_pool
        # KV offload (the engine gives a tier only with prefix caching on): evicted cached
        # blocks go to host slots, lookups continue there.
        self.host_tier = host_tier
        self._copies = HostCopies()
        if self.host_tier is not None:
            block_pool.on_evict = self._offload
        self.block_size = block_size
        self.hasher = hasher
        self.enable_caching = enable_caching
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many of its leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks registered by this pass's allocations: their KV is written by the step
        # this pass schedules, so no request admitted in the same pass may hit them. (The
        # batch-1-style decode kernel writes a new token's K/V and attends in one launch:
        # a hit on a block another program of that launch is still writing would race it.)
        self._registered_this_pass: set[int] = set()
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

        The last token is always computed because its logits are needed to sample; a
        request asking for prompt logprobs computes every position (no hit). The
        blocks are not touched here; ``allocate_slots`` takes them. A block registered in
        this pass ends the run: its KV is computed by the step being scheduled.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (as vLLM)
        self.hasher.update_request_hashes(request)
        max_blocks = max(request.num_tokens - 1, 0) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or block.block_id in self._registered_this_pass:
                break
            hits.append(block)
        if self.host_tier is not None and len(hits) < max_blocks:
            hits += self._onload(hits, request.block_hashes[len(hits):max_blocks])
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
        if num_external_tokens:
            self._cache_up_to(request, local_end)
        else:
            self._cache_up_to(request, local_end + num_new_tokens, written_from=local_end)
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

    def end_pass(self) -> HostCopies | None:
        """The scheduling pass is over: its registered blocks may be hit from the next pass
        on (that step runs after this one's on the device). Returns the host copies the
        pass planned (None without KV offload); the slots its lookups served are free to
        reuse from the next pass on."""
        self._registered_this_pass.clear()
        if self.host_tier is None:
            return None
        copies, self._copies = self._copies, HostCopies()
        self.host_tier.end_pass()
        return copies

    def reset_prefix_cache(self, keep_host: bool = False) -> bool:
        """Drop every cached hash (host memory's too unless ``keep_host``: sleep mode drops
        only the device's); False while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_tier is not None and not keep_host:
            self.host_tier.clear()
        # Nothing is owned, so no per-request cache pointer can outlive the reset.
        self._num_cached_blocks.clear()
        self._registered_this_pass.clear()
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

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        """BlockPool's eviction hook: keep the evicted content in a host slot if one is free."""
        assert self.host_tier is not None
        slot = self.host_tier.store(block_hash)
        if slot is not None:
            self._copies.offload_blocks.append(block_id)
            self._copies.offload_slots.append(slot)

    def _onload(self, device_hits: list[KVCacheBlock],
                hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Continue a prefix from host memory: each hash found there gets a free device block,
        cached under it, with an upload planned; the blocks go back to the free queue as
        evictable cached blocks, so the caller's ``allocate_slots`` takes them as any hit
        (and a failed allocation leaves a consistent cache behind)."""
        assert self.host_tier is not None
        # Free blocks the uploads may take: not the device hits that sit in the free queue.
        room = self.block_pool.num_free_blocks - sum(1 for b in device_hits if b.ref_cnt == 0)
        slots: list[int] = []
        for block_hash in hashes[:max(room, 0)]:
            # Content the device still caches further on would make a second copy that the
            # cache map cannot hold: the prefix ends here (the device part is found next time).
            if self.block_pool.get_cached_block(block_hash) is not None:
                break
            slot = self.host_tier.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return []
        # Hold the device hits so taking free blocks cannot evict them.
        self.block_pool.touch(device_hits)
        blocks = self.block_pool.get_new_blocks(len(slots))
        for block, block_hash, slot in zip(blocks, hashes, slots):
            self.block_pool.cache_block(block, block_hash)
            self._copies.onload_slots.append(slot)
            self._copies.onload_blocks.append(block.block_id)
        self.block_pool.free_blocks(reversed(blocks))
        self.block_pool.free_blocks(reversed(device_hits))
        return blocks

    def _check_hits_still_cached(self, request: Request,
                                 hits: Sequence[KVCacheBlock]) -> None:
        """A hit evicted between lookup and allocation would silently serve wrong KV."""
        for index, block in enumerate(hits):
            if (index >= len(request.block_hashes)
                    or block.block_hash != request.block_hashes[index]):
                raise ValueError(f"request {request.request_id}: prefix-hit block "
                                 f"{block.block_id} was evicted after get_computed_blocks")

    def _cache_up_to(self, request: Request, num_tokens: int,
                     written_from: int | None = None) -> None:
        """Register the request's full blocks covering tokens [0, num_tokens); those holding
        a token at or past ``written_from`` are computed by the step this pass schedules."""
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
            if written_from is not None and (index + 1) * self.block_size > written_from:
                self._registered_this_pass.add(blocks[index].block_id)
        if num_full > start:
            self._num_cached_blocks[request.request_id] = num_full
