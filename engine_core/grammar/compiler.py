"""Compiles grammar specs against the model's tokenizer, off the engine loop, with a cache.

A JSON schema takes milliseconds to tens of milliseconds to compile (the first one also
loads the tokenizer's vocabulary), so compiles run on a small thread pool while the
request waits in the scheduler. The cache is a bounded LRU of futures keyed by
``GrammarSpec`` (kind and source text): a spec compiles once even when many requests ask
for it at the same moment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.grammar.matcher import SequenceGrammar
from engine_core.grammar.spec import GrammarSpec, build_grammar, grammar_spec, native_message
from engine_core.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("pdserve.grammar")

COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Spec -> future of an ``xgrammar.CompiledGrammar`` for one tokenizer and vocabulary.

    ``vocab_size`` is the logits' width (it may exceed the tokenizer's vocabulary);
    ``stop_token_ids`` are the tokens that end a sequence once its grammar is complete.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = MAX_CACHED_GRAMMARS, threads: int = COMPILE_THREADS) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_cached = max_cached
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._xgr_compiler: Any = None  # built by the first compile (loads the tokenizer)

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """The compile of ``spec``: cached, or started now on the pool."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def sequence_grammar(self, params: StructuredOutputsParams | None) -> SequenceGrammar | None:
        """A new sequence's grammar state for ``params`` (None: unconstrained); raise
        InvalidRequestError for a spec that cannot be compiled at all."""
        if params is None:
            return None
        return SequenceGrammar(self.submit(grammar_spec(params)))

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, spec: GrammarSpec) -> Any:
        started = time.perf_counter()
        grammar = build_grammar(spec)
        try:
            compiled = self._compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(f"the grammar does not compile: {native_message(exc)}",
                                      "structured_outputs") from None
        logger.debug("Compiled a %s grammar in %.1f ms", spec.kind,
                     (time.perf_counter() - started) * 1e3)
        return compiled

    def _compiler(self) -> Any:
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                from engine_core.hf_tokenizer import load_hf_tokenizer

                tokenizer = load_hf_tokenizer(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids))
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                         cache_enabled=False)
            return self._xgr_compiler

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
