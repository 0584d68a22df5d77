"""Grammar masks on the logits in place: every token a packed bitmask row forbids gets -inf.

The bitmask is xgrammar's layout, ``[R, ceil(V / 32)]`` int32 with bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. One launch covers the batch: a program takes
``WORDS`` words of one row, expands them to ``WORDS * 32`` bits in registers and stores -inf
only where a bit is clear. The logits are never read and no vocabulary-sized mask tensor is
made, so the cost is one read of the packed words plus the writes of forbidden entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.grammar.bitmask import num_words as words_for

WORDS = 32  # words per program: 1,024 tokens; 149 programs a row for a 151,936 vocabulary


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, vocab, num_words, logits_stride,
                          bitmask_stride, WORDS: tl.constexpr):
    row = tl.program_id(0)
    word_index = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    words = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_stride + word_index,
                    mask=word_index < num_words, other=-1)
    bit = tl.arange(0, 32)
    forbidden = ((words[:, None] >> bit[None, :]) & 1) == 0
    tokens = word_index[:, None] * 32 + bit[None, :]
    minus_inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row.to(tl.int64) * logits_stride + tokens, minus_inf,
             mask=forbidden & (tokens < vocab))


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, t]`` to -inf wherever bit ``t`` of ``bitmask[r]`` is clear (``logits``
    ``[R, V]`` on the GPU, rows contiguous; ``bitmask`` ``[R, >= ceil(V / 32)]`` int32 on
    the same device). Tokens at or past ``V`` are ignored."""
    rows, vocab = logits.shape
    num_words = words_for(vocab)
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == rows, bitmask.shape
    assert bitmask.shape[1] >= num_words and bitmask.stride(1) == 1, bitmask.shape
    assert logits.stride(1) == 1, "the kernel writes rows as contiguous runs"
    if rows == 0:
        return
    grid = (rows, triton.cdiv(num_words, WORDS))
    _apply_bitmask_kernel[grid](logits, bitmask, vocab, num_words, logits.stride(0),
                                bitmask.stride(0), WORDS=WORDS, num_warps=4)
