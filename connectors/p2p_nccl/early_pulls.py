"""What a producer remembers about transfers by id alone: pulls and releases that came before
their prefill's save (``EarlyPulls``), and transfers it will never send (``Tombstones``).

Both are bounded and expire by age, and hold no bytes; the producer guards them with its lock.
"""

from __future__ import annotations

from connectors.p2p_nccl.messages import KVPullRequest

MAX_TOMBSTONES = 65536


class EarlyPulls(dict[str, tuple[KVPullRequest, float]]):
    """Pulls and releases (``num_blocks == 0``) that arrived before their save, with their
    arrival time, oldest first. A pull is a decode worker waiting; a release holds nothing
    and only ends the save unsent when it comes."""

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop what waited longer than ``ttl_s``; the number dropped."""
        old = [transfer_id for transfer_id, (_, arrived) in self.items() if now - arrived > ttl_s]
        for transfer_id in old:
            del self[transfer_id]
        return len(old)

    def has_waiting_pull(self) -> bool:
        """Whether a pull (not a release) waits: a producer's idleness, asked every step."""
        return any(pull.num_blocks > 0 for pull, _ in self.values())

    def waiting_pulls(self) -> int:
        """Pulls (not releases) waiting."""
        return sum(1 for pull, _ in self.values() if pull.num_blocks > 0)

    def evict_oldest_release(self) -> bool:
        """Drop the oldest waiting release to make room for a pull; False when none waits.
        Its KV, should the save still come, then waits for its lease."""
        for transfer_id, (waiting, _) in self.items():
            if waiting.num_blocks == 0:
                del self[transfer_id]
                return True
        return False


class Tombstones:
    """Transfer ids a producer will never send (sent, released, abandoned, lease expired),
    each kept ``ttl_s``: a late pull for one is answered with an abort at once. Kept in
    expiry order (re-inserted at the end), so expiring stops at the first live one."""

    def __init__(self, ttl_s: float, capacity: int = MAX_TOMBSTONES) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._expiry: dict[str, float] = {}

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, transfer_id: str, now: float) -> None:
        self._expiry.pop(transfer_id, None)
        self._expiry[transfer_id] = now + self._ttl_s
        while len(self._expiry) > self._capacity:
            del self._expiry[next(iter(self._expiry))]

    def expire(self, now: float) -> None:
        """Drop the expired ones, oldest first: each call costs the expired ones only, not
        every transfer sent in the last ``ttl_s``."""
        while self._expiry:
            transfer_id, expiry = next(iter(self._expiry.items()))
            if now <= expiry:
                return
            del self._expiry[transfer_id]
