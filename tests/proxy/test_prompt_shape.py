"""The proxy's prompt estimate hashes a bounded prefix: a huge prompt costs its loop little."""

from __future__ import annotations

from proxy.prefix_index import (
    CHARS_PER_TOKEN,
    MAX_SHAPE_BLOCKS,
    TOKENS_PER_BLOCK,
    prompt_shape,
)


def test_a_huge_text_prompt_hashes_a_bounded_prefix() -> None:
    text = "the lazy dog " * (1 << 20)  # 13 MB
    shape = prompt_shape("/v1/completions", {"prompt": text})
    assert shape.num_tokens == -(-len(text) // CHARS_PER_TOKEN)  # the size is the whole one
    assert len(shape.block_hashes) == MAX_SHAPE_BLOCKS
    head = text[:10 * TOKENS_PER_BLOCK * CHARS_PER_TOKEN]
    assert prompt_shape("/v1/completions", {"prompt": head}).block_hashes == \
        shape.block_hashes[:10]


def test_a_huge_token_prompt_hashes_a_bounded_prefix() -> None:
    ids = list(range(7)) * (1 << 18)
    shape = prompt_shape("/v1/completions", {"prompt": ids})
    assert shape.num_tokens == len(ids)
    assert len(shape.block_hashes) == MAX_SHAPE_BLOCKS
