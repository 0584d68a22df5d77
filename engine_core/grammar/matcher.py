"""One sequence's grammar: the compile it waits for, then the matcher its tokens advance.

The scheduler polls ``ready`` before admitting the request (vLLM's WAITING_FOR_FSM); the
matcher then replays the output tokens the request already has (a first token sampled by
the prefill worker, tokens kept across a preemption) so it starts where the sequence is.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from engine_core.errors import InvalidRequestError

logger = logging.getLogger("pdserve.grammar")


class SequenceGrammar:
    """The grammar state of one engine request (one sample of an API request)."""

    def __init__(self, compiled: Future[Any]) -> None:
        self._compiled = compiled
        self.matcher: Any = None
        self.vocab_size = 0  # the bitmask's width, from the compiled grammar
        self.error: str | None = None

    def ready(self, output_token_ids: list[int]) -> bool:
        """True once the matcher is built (from ``output_token_ids`` on) or ``error`` says
        why it cannot be."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            compiled = self._compiled.result()
        except InvalidRequestError as exc:
            self.error = str(exc)
            return True
        except Exception as exc:  # a compile crash fails this request, not the engine
            logger.exception("grammar compile failed")
            self.error = f"grammar compile failed: {exc!r:.200}"
            return True
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        for token in output_token_ids:
            if not matcher.accept_token(token):
                self.error = "the tokens generated so far do not match the grammar"
                return True
        self.matcher = matcher
        return True

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it."""
        return bool(self.matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self.matcher.is_terminated())
