"""Block hashes: deterministic, chained, seeded, and only over full blocks."""

from __future__ import annotations

import pytest

from engine_core.config import CacheConfig
from engine_core.errors import ConfigError
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher

BLOCK = 4


def make_request(token_ids: list[int], request_id: str = "r") -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(token_ids),
                   sampling_params=SamplingParams())


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_deterministic_across_instances(algo: str) -> None:
    tokens = list(range(10))
    first = BlockHasher(BLOCK, algo).hash_tokens(tokens)
    second = BlockHasher(BLOCK, algo).hash_tokens(tokens)
    assert first == second
    assert len(first) == 2
    assert len(set(first)) == 2
    assert all(isinstance(h, bytes) for h in first)
    assert len(first[0]) == (32 if algo == "sha256" else 16)


# Known answers: a change here breaks agreement between workers of different versions,
# and would show Python's per-process salted hash() leaking into the format.
GOLDEN = {
    "sha256": "6541c6b78de5607804057e1c8e71ff59bb131d03b68c5b4ce2d5d885ac561090",
    "xxhash": "7c3dff963e053cbb7dfaca3b90eb100d",
}


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_known_answer(algo: str) -> None:
    assert BlockHasher(BLOCK, algo).hash_tokens(list(range(8)))[-1].hex() == GOLDEN[algo]


def test_algos_differ() -> None:
    tokens = list(range(8))
    assert BlockHasher(BLOCK, "sha256").hash_tokens(tokens) != \
        BlockHasher(BLOCK, "xxhash").hash_tokens(tokens)


def test_chain_sensitivity() -> None:
    hasher = BlockHasher(BLOCK)
    base = hasher.hash_tokens(list(range(12)))
    changed = hasher.hash_tokens([99] + list(range(1, 12)))
    assert all(a != b for a, b in zip(base, changed, strict=True))
    # Changing only the last block leaves earlier hashes alone.
    tail_changed = hasher.hash_tokens(list(range(11)) + [99])
    assert tail_changed[:2] == base[:2] and tail_changed[2] != base[2]


def test_same_block_under_different_parents_differs() -> None:
    hasher = BlockHasher(BLOCK)
    block = [7, 7, 7, 7]
    assert hasher.hash_block(None, block) != hasher.hash_block(hasher.hash_block(None, block), block)


def test_seed_sensitivity() -> None:
    tokens = list(range(8))
    assert BlockHasher(BLOCK, seed="a").hash_tokens(tokens) != \
        BlockHasher(BLOCK, seed="b").hash_tokens(tokens)


def test_extra_keys_change_hash_and_are_deterministic() -> None:
    hasher = BlockHasher(BLOCK)
    tokens = [1, 2, 3, 4]
    plain = hasher.hash_block(None, tokens)
    lora = hasher.hash_block(None, tokens, ("lora-a",))
    assert plain != lora
    assert lora == BlockHasher(BLOCK).hash_block(None, tokens, ("lora-a",))
    assert hasher.hash_block(None, tokens, (1,)) != hasher.hash_block(None, tokens, ("1",))
    assert hasher.hash_block(None, tokens, ((1, 2), 3)) != hasher.hash_block(None, tokens, (1, (2, 3)))
    with pytest.raises(TypeError):
        hasher.hash_block(None, tokens, (object(),))


def test_partial_blocks_never_hashed() -> None:
    hasher = BlockHasher(BLOCK)
    assert hasher.hash_tokens([1, 2, 3]) == []
    assert len(hasher.hash_tokens(list(range(7)))) == 1
    assert len(hasher.hash_tokens(list(range(8)))) == 2


def test_update_request_hashes_is_incremental() -> None:
    hasher = BlockHasher(BLOCK)
    request = make_request([1, 2, 3, 4, 5, 6])
    hasher.update_request_hashes(request)
    assert request.block_hashes == hasher.hash_tokens([1, 2, 3, 4])
    first = request.block_hashes[0]
    for token in (7, 8, 9):
        request.append_token(token)
        hasher.update_request_hashes(request)
    assert request.block_hashes[0] is first  # existing hashes are not recomputed
    assert request.block_hashes == hasher.hash_tokens(request.token_ids)
    assert len(request.block_hashes) == 2
    hasher.update_request_hashes(request)
    assert len(request.block_hashes) == 2


def test_from_config_and_validation() -> None:
    config = CacheConfig(block_size=8, prefix_caching_hash_algo="xxhash", prefix_hash_seed="s")
    hasher = BlockHasher.from_config(config)
    assert (hasher.block_size, hasher.algo, hasher.seed) == (8, "xxhash", "s")
    with pytest.raises(ConfigError):
        BlockHasher(BLOCK, "md5")
    with pytest.raises(ConfigError):
        BlockHasher(0)
