"""Packed token bitmasks: filled on the host per step, applied to the logits on the device.

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` is allowed (xgrammar's
layout). The scheduler fills one int32 row per constrained request that samples this step
with one batched xgrammar call; the runner lays them out in the step's sampling order
(unconstrained rows all ones) and copies the block to the device in one transfer; the
sampler unpacks and masks with fixed-shape tensor ops before anything else touches the
logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MASK = float("-inf")


def num_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


@dataclass
class GrammarBitmask:
    """One step's masks: ``words[i]`` is the mask of ``request_ids[i]``."""

    request_ids: list[str]
    words: np.ndarray  # [len(request_ids), num_words] int32

    def for_rows(self, row_request_ids: list[str]) -> np.ndarray | None:
        """The masks in the order of ``row_request_ids`` (rows not constrained allow every
        token); None when none of those rows is constrained."""
        where = {request_id: i for i, request_id in enumerate(self.request_ids)}
        dst = [row for row, request_id in enumerate(row_request_ids) if request_id in where]
        if not dst:
            return None
        src = [where[row_request_ids[row]] for row in dst]
        rows = np.full((len(row_request_ids), self.words.shape[1]), -1, dtype=np.int32)
        rows[dst] = self.words[src]
        return rows


# Threads of the batched fill (the step waits for its masks).
FILL_THREADS = 8


class BitmaskFiller:
    """Fills the next-token masks of a step's matchers (xgrammar ``GrammarMatcher``s) in one
    batched, multi-threaded call; one per scheduler, made with its first grammar."""

    def __init__(self, max_threads: int = FILL_THREADS) -> None:
        import xgrammar as xgr

        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def fill(self, request_ids: list[str], matchers: list[Any],
             vocab_size: int) -> GrammarBitmask:
        words = np.full((len(matchers), num_words(vocab_size)), -1, dtype=np.int32)
        tensor = torch.from_numpy(words)  # shares memory: xgrammar writes into ``words``
        self._batch.batch_fill_next_token_bitmask(matchers, tensor)
        return GrammarBitmask(request_ids, words)


def bitmask_to_device(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """The step's mask rows on the device in one (non-blocking, on CUDA) copy."""
    host = torch.from_numpy(rows)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the mask forbids at -inf. Fixed shapes throughout (rows
    x words x 32 bits, cut to the vocabulary), so a CUDA graph can hold it."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]].bool()
    return logits.masked_fill(~allowed, _MASK)
