"""The API process's tokenizer: prompts and chat messages to token ids, and back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from engine_core.errors import InvalidRequestError
from engine_core.request_limits import check_context
from engine_core.server.protocol import ChatTemplateOptions, Prompt

_T = TypeVar("_T")

# Threads tokenizing at once: a long prompt holds one of them, not the other requests.
TOKENIZER_THREADS = 4
# Characters one token covers at most when the vocabulary cannot say (``longest_token_chars``).
FALLBACK_CHARS_PER_TOKEN = 32


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters (or bytes, for byte-level vocabularies) one token stands for: a
    text longer than ``max_model_len`` times this cannot fit the context, whatever it says."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a listable vocabulary
        return FALLBACK_CHARS_PER_TOKEN
    return max((len(token) for token in vocab), default=FALLBACK_CHARS_PER_TOKEN)


class TokenizerService:
    """Wraps the HF tokenizer the engine names (``EngineInfo.tokenizer_path``)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 kv_capacity: int | None = None, own_thread: bool = False,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        # The server's --chat-template, in place of the tokenizer's own (None: its own).
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Tokens the worker's whole KV cache holds (None: unknown, the engine checks alone).
        self.kv_capacity = kv_capacity
        # A text longer than this is refused before it is tokenized (``encode``): it cannot
        # fit the context, and tokenizing megabytes takes seconds and keeps memory.
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        # ``call`` runs tokenizer work on these threads, so a long prompt holds one thread
        # and neither the event loop nor the other requests.
        self._thread = None
        if own_thread:
            # One encode first, alone: it settles the backend's truncation and padding
            # state, which later encodes only read (concurrent writes would collide).
            tokenizer.encode("", add_special_tokens=False)
            self._thread = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")
        # apply_chat_template's own parameters: chat_template_kwargs may not set them (a
        # client's tokenize=True or chat_template would change what rendering means).
        self._template_params = frozenset(
            name for name, param in inspect.signature(tokenizer.apply_chat_template)
            .parameters.items() if param.kind is not param.VAR_KEYWORD)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's eos token id (vLLM stops every request at it)."""
        return getattr(self.tokenizer, "eos_token_id", None)

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` (this service's encode or decode work) on a tokenizer thread, so
        that a long prompt holds that thread, not the event loop (every stream, /health, the
        heartbeats) nor other requests' tokenizing (the HF tokenizer releases the GIL while
        it works). Inline without threads (tests)."""
        if self._thread is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the tokenizer's thread (calls already running finish)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)

    @classmethod
    def load(cls, path: str, max_model_len: int, vocab_size: int,
             trust_remote_code: bool = False, kv_capacity: int | None = None,
             chat_template: str | None = None, hf_tokenizer: Any = None) -> TokenizerService:
        """The service around ``hf_tokenizer``, or around the one loaded from ``path``."""
        from engine_core.hf_tokenizer import load_hf_tokenizer

        tokenizer = (load_hf_tokenizer(path, trust_remote_code) if hf_tokenizer is None
                     else hf_tokenizer)
        return cls(tokenizer, max_model_len, vocab_size, kv_capacity, own_thread=True,
                   chat_template=chat_template)

    def encode(self, text: str, add_special_tokens: bool = True,
               truncating: bool = False) -> list[int]:
        """Token ids of ``text``; one too long to fit the context is refused untokenized,
        unless the caller keeps only its last tokens (``truncating``)."""
        if not truncating and len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters: more than the {self.max_prompt_chars} "
                f"that can fit this model's context of {self.max_model_len} tokens", "prompt")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError, UnicodeError) as exc:  # e.g. a lone surrogate
            raise InvalidRequestError(f"the text cannot be tokenized: {exc}", "prompt") from None

    def encode_prompt(self, prompt: Prompt, truncate: int | None = None,
                      add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (its last ``truncate`` ones when given), checked
        against the vocabulary and context."""
        ids = (self.encode(prompt, add_special_tokens, truncate is not None)
               if isinstance(prompt, str)
               else list(prompt))
        ids = self._truncated(ids, truncate)
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization", "prompt")
        if max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must be below the vocabulary size "
                                      f"{self.vocab_size}", "prompt")
        self.check_length(len(ids))
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    truncate: int | None = None, options: ChatTemplateOptions | None = None
                    ) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (the last ``truncate``
        ones when given)."""
        options = options or ChatTemplateOptions()
        text = self.render_chat(messages, add_generation_prompt, options)
        if options.tools and text == self.render_chat(
                messages, add_generation_prompt, replace(options, tools=None)):
            raise InvalidRequestError("this model's chat template does not render tools; "
                                      "serve it with a --chat-template that does", "tools")
        ids = self._truncated(self.encode(text, options.add_special_tokens, truncate is not None),
                              truncate)
        self.check_length(len(ids))
        return ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    options: ChatTemplateOptions) -> str:
        """The chat template's text for ``messages`` (and the request's tools)."""
        if not (self.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise InvalidRequestError("this model's tokenizer has no chat template; "
                                      "use /v1/completions", "messages")
        reserved = sorted(self._template_params & options.chat_template_kwargs.keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}: they are "
                                      "the request's own fields or not settable",
                                      "chat_template_kwargs")
        # Tools and a template override go only when given: None is the tokenizer's default.
        given = {name: value for name, value in (("tools", options.tools),
                                                 ("chat_template", self.chat_template))
                 if value is not None}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=options.continue_final_message,
                documents=options.documents, **given, **options.chat_template_kwargs)
        except Exception as exc:  # template errors are the client's messages' fault
            raise InvalidRequestError(f"chat template failed: {exc}", "messages") from None

    def _truncated(self, ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``truncate`` ids (-1: the context
        length); a value beyond the context length is refused, as vLLM does."""
        if truncate is None:
            return ids
        if truncate > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({truncate}) is greater than the model's context "
                f"length ({self.max_model_len})", "truncate_prompt_tokens")
        return ids[-(self.max_model_len if truncate == -1 else truncate):]

    def check_length(self, num_tokens: int, max_tokens: int | None = None) -> None:
        """Reject prompts that leave no room for output, or output beyond the context or the
        whole KV cache (``request_limits.check_context``, the engine's own rule): this also
        covers the client's own limit where the engine runs fewer tokens (a prefill worker
        sampling the first token for the handoff)."""
        check_context(num_tokens, max_tokens, self.max_model_len, self.kv_capacity)

    def decode(self, token_ids: list[int]) -> str:
        if token_ids and max(token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must be below {self.vocab_size}", "tokens")
        return self.tokenizer.decode(token_ids)


def preload_hf_tokenizer(path: str, trust_remote_code: bool
                         ) -> concurrent.futures.Future | None:
    """The HF tokenizer of the local checkpoint folder ``path``, loading on a daemon thread
    (None for anything else: a hub name may mean network retries, which must neither
    delay the start nor hold the process at exit)."""
    if not Path(path).is_dir():
        return None
    from engine_core.hf_tokenizer import load_hf_tokenizer

    future: concurrent.futures.Future = concurrent.futures.Future()

    def load() -> None:
        try:
            future.set_result(load_hf_tokenizer(path, trust_remote_code))
        except BaseException as exc:  # reported by the load after the engine is up
            future.set_exception(exc)

    threading.Thread(target=load, name="tokenizer-preload", daemon=True).start()
    return future
