"""The tokenizer's bounds: a prompt too long to fit the context is refused before it is
tokenized, and tokenizing runs on a pool, so one long prompt holds neither the event loop
nor the other requests' tokenizing. A stand-in tokenizer: no timings, only order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.server.tokenization import TokenizerService, longest_token_chars

MAX_MODEL_LEN = 64


class _Tokenizer:
    """One token per character; a text starting with "slow" blocks until released."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.encoded: list[int] = []  # the length of every text encoded
        self.release = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1, "b": 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("slow"):
            assert self.release.wait(30)
        self.encoded.append(len(text))
        return [0] * len(text)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, documents=None) -> str:
        return "".join(m["content"] for m in messages)

    def decode(self, ids: list[int]) -> str:
        return "a" * len(ids)


@pytest.fixture
def tokenizer() -> _Tokenizer:
    return _Tokenizer()


def test_the_bound_is_the_longest_token_times_the_context(tokenizer: _Tokenizer) -> None:
    assert longest_token_chars(tokenizer) == 4
    assert TokenizerService(tokenizer, MAX_MODEL_LEN, 3).max_prompt_chars == 4 * MAX_MODEL_LEN


def test_a_prompt_that_cannot_fit_is_refused_untokenized(tokenizer: _Tokenizer) -> None:
    """10 MB of prompt is a 400 at once: before, it was tokenized for 12-19 s and only then
    refused, and the worker kept gigabytes from it."""
    service = TokenizerService(tokenizer, MAX_MODEL_LEN, 3)
    for text in ("a" * (4 * MAX_MODEL_LEN + 1), "a" * 10_000_000):
        with pytest.raises(InvalidRequestError, match="characters"):
            service.encode_prompt(text)
        with pytest.raises(InvalidRequestError, match="characters"):
            service.encode_chat([{"role": "user", "content": text}])
    assert tokenizer.encoded == []
    # Under the bound, the token count decides (one token a character here).
    with pytest.raises(InvalidRequestError, match="context|model"):
        service.encode_prompt("a" * (MAX_MODEL_LEN + 1))
    assert service.encode_prompt("a" * 8) == [0] * 8


def test_a_truncated_prompt_is_tokenized_whole(tokenizer: _Tokenizer) -> None:
    """truncate_prompt_tokens keeps a long prompt's last tokens: it must be tokenized."""
    service = TokenizerService(tokenizer, MAX_MODEL_LEN, 3)
    assert service.encode_prompt("a" * 10 * MAX_MODEL_LEN, truncate=8) == [0] * 8


async def test_a_long_prompt_holds_one_thread_not_the_others(tokenizer: _Tokenizer) -> None:
    """While one prompt is being tokenized, a small request's tokenizing still completes:
    with one tokenizer thread it waited behind the long one (up to 7.4 s for 10 MB)."""
    service = TokenizerService(tokenizer, MAX_MODEL_LEN, 3, own_thread=True)
    try:
        slow = asyncio.ensure_future(service.call(service.encode, "slow" + "a" * 40))
        await asyncio.sleep(0)
        small = await asyncio.wait_for(service.call(service.encode_prompt, "ab"), 20)
        assert small == [0, 0]
        assert not slow.done()
        tokenizer.release.set()
        assert len(await asyncio.wait_for(slow, 20)) == 44
    finally:
        tokenizer.release.set()
        service.close()
