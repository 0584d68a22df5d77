"""What the proxy knows of a prompt before any worker sees it: its size and prefix blocks.

The proxy does not tokenize, so both are estimates. A token-id prompt is exact: its length,
and blocks of ``TOKENS_PER_BLOCK`` ids. Text (and chat messages, as role and content) counts
``CHARS_PER_TOKEN`` characters a token, in blocks of that many tokens' characters. Blocks
are chained hashes (each covers its whole prefix), as the engines' block hashes are.

``PrefixIndex`` remembers, per worker, the block hashes of prompts the proxy placed there
(the worker that computed the prompt and the one that received its KV both cache it), up to
``capacity`` blocks a worker, least recently used first out. A prompt's cached tokens on a
worker are its leading blocks found there. It cannot see evictions inside the engine, so it
is an upper bound that ages out; the engines' own prefix caches stay the truth.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

TOKENS_PER_BLOCK = 16
CHARS_PER_TOKEN = 4
CHAT_PATH = "/v1/chat/completions"
# Leading blocks hashed at most (131,072 tokens' worth, past any served context): a longer
# prompt's later blocks can match no cache, and hashing megabytes on the proxy's event loop
# would stall every other client.
MAX_SHAPE_BLOCKS = 8192


@dataclass(frozen=True)
class PromptShape:
    """A prompt's estimated token count and its chained block hashes."""

    num_tokens: int
    block_hashes: tuple[int, ...] = ()


def _chain(pieces: list[Any]) -> tuple[int, ...]:
    hashes: list[int] = []
    parent = 0
    for piece in pieces:
        parent = hash((parent, piece))
        hashes.append(parent)
    return tuple(hashes)


def chat_text(messages: Any) -> str | None:
    """A chat request's messages as one text (role and content each); None when malformed."""
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        parts.append(f"{message.get('role')}\n{text}\n")
    return "".join(parts)


def prompt_shape(path: str, body: dict[str, Any]) -> PromptShape:
    """The shape of a request's one prompt; a batch or an unreadable body counts as empty
    (the placement then treats it as short; the worker judges the body)."""
    if path == CHAT_PATH:
        text = chat_text(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            end = min(len(prompt), MAX_SHAPE_BLOCKS * TOKENS_PER_BLOCK)
            blocks = [tuple(prompt[i:i + TOKENS_PER_BLOCK])
                      for i in range(0, end - TOKENS_PER_BLOCK + 1, TOKENS_PER_BLOCK)]
            return PromptShape(len(prompt), _chain(blocks))
        text = prompt if isinstance(prompt, str) else None
    if text is None:
        return PromptShape(0)
    size = TOKENS_PER_BLOCK * CHARS_PER_TOKEN
    end = min(len(text), MAX_SHAPE_BLOCKS * size)
    blocks = [text[i:i + size] for i in range(0, end - size + 1, size)]
    return PromptShape(-(-len(text) // CHARS_PER_TOKEN), _chain(blocks))


class PrefixIndex:
    """Per worker, the prompt blocks it was last given (LRU, ``capacity`` blocks each)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def cached_tokens(self, worker_id: str, shape: PromptShape) -> int:
        """The prompt's leading tokens the worker is believed to hold."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        matched = 0
        for block_hash in shape.block_hashes:
            if block_hash not in blocks:
                break
            matched += 1
        return min(shape.num_tokens, matched * TOKENS_PER_BLOCK)

    def record(self, worker_id: str, shape: PromptShape) -> None:
        """The worker now holds the prompt's blocks (it computed or received them)."""
        if not shape.block_hashes:
            return
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for block_hash in shape.block_hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """The worker left (or restarted with an empty cache)."""
        self._blocks.pop(worker_id, None)
