"""Incremental detokenization with stop strings, shared by the offline ``LLM`` and the server.

Tokens arrive a few at a time. Decoding each new token alone is wrong for byte-level BPE
(one character may span several tokens) and for tokenizers that drop a leading space, so
we decode a small sliding window (``prefix_offset:``) and emit only the text past what the
window's older part (``prefix_offset:read_offset``) already produced. A window whose text
ends in U+FFFD is an incomplete character: we wait for the next token.

Stop strings are searched in the text only near its new end, and only in text of tokens
after the first ``min_tokens`` (vLLM's rule: min_tokens holds back every stop, EOS, stop ids
and stop strings alike). While streaming, the longest suffix that could still grow into a
stop string is held back, so an excluded stop string is never sent to a client and then
taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Prompt tokens kept as decoding context, so the first output token gets its leading space:
# the shortest suffix of at least _CONTEXT_TOKENS that decodes without U+FFFD, up to
# _MAX_CONTEXT_TOKENS. A suffix starting inside a multi-byte character decodes to U+FFFD, and
# byte-fallback decoders (Llama-2, Mistral, Gemma) then turn the whole byte run, the output's
# first bytes included, into U+FFFD.
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """Text released by one ``update``: ``text`` is new, ``stop_str`` set when one matched."""

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, applying stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        context = self._context(prompt_token_ids)
        self._window_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._num_released = 0
        self.stop_str: str | None = None

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt suffix the window starts with (see ``_CONTEXT_TOKENS``); the shortest
        one when every suffix holds U+FFFD (a prompt may contain the character itself)."""
        shortest = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        for length in range(_CONTEXT_TOKENS, min(len(prompt_token_ids), _MAX_CONTEXT_TOKENS) + 1):
            context = list(prompt_token_ids[-length:])
            if _REPLACEMENT_CHAR not in self._decode(context):
                return context
        return shortest

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later tokens are ignored."""
        return self.stop_str is not None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_next(self, flush: bool) -> str:
        """Text of the window past the already-read part; '' while a character is incomplete."""
        if self._read_offset >= len(self._window_ids) and not flush:
            return ""
        prefix_text = self._decode(self._window_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._window_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        new_text = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        return new_text

    def _check_stop(self, num_new_chars: int) -> None:
        """Truncate ``output_text`` at the earliest stop string touching the new text."""
        if not self._stop or num_new_chars == 0:
            return
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # Each stop string looks back only its own length into the older text: looking
            # back the longest one's let a short stop match in text min_tokens protected.
            start = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        self.output_text = self.output_text[:index + len(stop) if self._include_stop else index]
        self.stop_str = stop

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string.

        A suffix can only start where the text has a stop string's first character, so
        only those places in a stop's reach are tried: trying every length against every
        stop cost ~1 ms a token at the limits (16 stop strings of 1024 characters)."""
        text = self.output_text
        longest = 0
        for stop in self._stop:
            first, reach = stop[0], min(len(stop) - 1, len(text))
            start = text.find(first, len(text) - reach)
            while start >= 0 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break  # the earliest place is the longest suffix for this stop
                start = text.find(first, start + 1)
        return longest

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> DetokenizerUpdate:
        """Add tokens; return the text now safe to release (all of it when ``finished``)."""
        if not self.stopped:
            self._window_ids.extend(new_token_ids)
            self._num_output_tokens += len(new_token_ids)
            new_text = self._decode_next(flush=finished)
            self.output_text += new_text
            if self._num_output_tokens > self._min_tokens:
                self._check_stop(len(new_text))
            # Keep the window short: decoding cost must not grow with the output length.
            if self._prefix_offset > 64:
                drop = self._prefix_offset
                self._window_ids = self._window_ids[drop:]
                self._prefix_offset -= drop
                self._read_offset -= drop
        end = len(self.output_text)
        if not (finished or self.stopped):
            end -= self._holdback()
        released = self.output_text[self._num_released:end] if end > self._num_released else ""
        self._num_released = max(self._num_released, end)
        return DetokenizerUpdate(text=released, stop_str=self.stop_str)
