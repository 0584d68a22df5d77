"""Token embedding and the LM head (its transpose, possibly tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.layers.linear import takes_gemv


class VocabEmbedding(nn.Module):
    """Looks up ``[vocab, hidden]`` rows for token ids."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits, returned in float32 for the sampler.

    Up to ``gemv_max_rows`` rows (the Triton path's small batches) go through the Triton
    GEMV, whatever the vocabulary: Qwen3-8B's 1.24 GB head at 1-8 rows took 414-416 us on
    an H100, the copy rate, against cuBLAS's 439-516 us (experiments/decode_floor.py; the
    8B batch-1 step: 6.002 ms against 6.028).
    """

    def __init__(self, vocab_size: int, hidden_size: int, gemv_max_rows: int = 0,
                 pdl: bool = True) -> None:
        super().__init__()
        self.gemv_max_rows = gemv_max_rows
        self.pdl = pdl  # the GEMV launches with PDL (DeviceConfig.triton_pdl)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding matrix (``tie_word_embeddings``): one tensor, not a copy."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (as HF does); only the result is upcast.
        if takes_gemv(hidden, self.gemv_max_rows):
            from engine_core.kernels.gemv import gemv

            return gemv(hidden, self.weight, out_dtype=torch.float32, pdl=self.pdl)
        return F.linear(hidden, self.weight).float()
