"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its token ids and any extra keys (LoRA name,
multimodal ids), so equal hashes mean equal prefixes. The chain starts from a root
derived from a cluster-wide seed, never from a per-process value such as Python's
``hash()``: prefill, decode and proxy must agree on every hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine_core.config import HASH_ALGOS, CacheConfig
from engine_core.errors import ConfigError

if TYPE_CHECKING:
    from engine_core.request import Request

BlockHash = bytes


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # only needed when a deployment picks it

    return xxhash.xxh3_128_digest(data)


def _encode_key(key: Any, out: list[bytes]) -> None:
    """Serialise one extra key with a type tag and a length, so no two keys collide."""
    if key is None:
        out.append(b"n")
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out.append(b"?1" if key else b"?0")
    elif isinstance(key, int):
        digits = str(key).encode()
        out.append(b"i" + struct.pack("<I", len(digits)) + digits)
    elif isinstance(key, float):
        out.append(b"f" + struct.pack("<d", key))
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, (bytes, bytearray)):
        out.append(b"b" + struct.pack("<I", len(key)) + bytes(key))
    elif isinstance(key, (tuple, list)):
        out.append(b"t" + struct.pack("<I", len(key)))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(f"block-hash extra key of type {type(key).__name__} is not hashable "
                        "deterministically; use int, str, bytes, float, None or tuples of them")


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens into a chain rooted at ``seed``."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = "pdserve-v1") -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if algo not in HASH_ALGOS:
            raise ConfigError(f"block hash algo must be one of {HASH_ALGOS}, got {algo!r}")
        self.block_size = block_size
        self.algo = algo
        self.seed = seed
        self._digest: Callable[[bytes], bytes] = _sha256 if algo == "sha256" else _xxh3_128
        # The algo name is part of the root so two algos never share a key space.
        self.root_hash: BlockHash = self._digest(f"pdserve-root/{algo}/{seed}".encode())

    @classmethod
    def from_config(cls, cache_config: CacheConfig) -> BlockHasher:
        """The hasher every process of a cluster builds from the same ``CacheConfig``."""
        return cls(cache_config.block_size, cache_config.prefix_caching_hash_algo,
                   cache_config.prefix_hash_seed)

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: tuple = ()) -> BlockHash:
        """Hash one block given its parent's hash (``None`` for the first block)."""
        parts = [parent if parent is not None else self.root_hash,
                 struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)]
        if extra_keys:
            _encode_key(tuple(extra_keys), parts)
        return self._digest(b"".join(parts))

    def hash_tokens(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``; a trailing partial block is skipped."""
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = self.hash_block(parent, token_ids[start:start + size], extra_keys)
            hashes.append(parent)
        return hashes

    def update_request_hashes(self, request: Request, extra_keys: tuple = ()) -> None:
        """Append hashes of the blocks of ``request.token_ids`` that became full since last call."""
        hashes = request.block_hashes
        token_ids = request.token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else None
        start = len(hashes) * size
        while start + size <= len(token_ids):
            parent = self.hash_block(parent, token_ids[start:start + size], extra_keys)
            hashes.append(parent)
            start += size
