"""KV offload's bookkeeping: which block hashes host memory holds, in which slot (no tensors).

Why a second tier: device memory holds a few thousand blocks; a prefix evicted from it would
be recomputed on its next use. With ``--kv-offloading-size`` the content of a cached block is
copied to a host slot when the device evicts it, and a later prefix lookup that misses on the
device but finds the hash here copies it back instead of recomputing it.

The copies themselves are ordered on the engine's stream (worker/host_kv.py); this module keeps
the rules that make them safe:
- a slot whose download has not landed yet is *pending*: never served, never reused;
- a slot a lookup served in the current scheduling pass is *pinned* until the pass's copies
  are taken (the step reads it at launch), so no store of the same pass overwrites it;
- a hash already held is never copied again (a block onloaded from here and evicted again
  stores nothing).
Least recently used ready, unpinned slots are reused first.
"""

from __future__ import annotations

from collections import OrderedDict

from engine_core.sched.block_hash import BlockHash


class HostTier:
    """Hash -> host slot map with LRU reuse; counts in blocks."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._hash_of: dict[int, BlockHash] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pending: set[int] = set()
        self._pinned: set[int] = set()
        # Pending slots a reset forgot: still written by their download, so not free until
        # it lands, and never served (their hash is gone).
        self._forgotten: set[int] = set()
        self.stored_blocks = 0   # downloads started
        self.loaded_blocks = 0   # lookups served (uploads)
        self.dropped_blocks = 0  # evictions that found no slot to take

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The ready slot holding ``block_hash`` (now most recently used and pinned for this
        pass), or None."""
        slot = self._slot_of.get(block_hash)
        if slot is None or slot in self._pending:
            return None
        self._slot_of.move_to_end(block_hash)
        self._pinned.add(slot)
        self.loaded_blocks += 1
        return slot

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot to download ``block_hash`` into (pending until ``landed``), or None: held
        already (made most recent), or no slot is free or reusable."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._reuse()
        if slot is None:
            self.dropped_blocks += 1
            return None
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._pending.add(slot)
        self.stored_blocks += 1
        return slot

    def landed(self, slots: list[int]) -> None:
        """These downloads finished: their slots may be served (or, forgotten by a reset
        meanwhile, reused)."""
        self._pending.difference_update(slots)
        freed = self._forgotten.intersection(slots)
        self._forgotten -= freed
        self._free.extend(freed)

    def end_pass(self) -> None:
        """The scheduling pass's copies were taken: its lookups no longer pin slots."""
        self._pinned.clear()

    def clear(self) -> None:
        """Forget every hash (a prefix-cache reset). A slot whose download is still in
        flight is freed once it lands, never served under its old hash after the reset."""
        for slot in self._hash_of:
            if slot in self._pending:
                self._forgotten.add(slot)
            else:
                self._free.append(slot)
        self._slot_of = OrderedDict()
        self._hash_of = {}

    def _reuse(self) -> int | None:
        for block_hash, slot in self._slot_of.items():
            if slot not in self._pending and slot not in self._pinned:
                del self._slot_of[block_hash]
                del self._hash_of[slot]
                return slot
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError on a broken invariant (tests)."""
        assert len(self._slot_of) == len(self._hash_of)
        for block_hash, slot in self._slot_of.items():
            assert self._hash_of[slot] == block_hash
        held = set(self._hash_of) | self._forgotten
        assert not set(self._hash_of) & self._forgotten
        assert not held & set(self._free), "a slot is both held and free"
        assert len(held) + len(self._free) == self.num_slots, "a slot was lost"
        assert self._pending <= held and self._forgotten <= self._pending
