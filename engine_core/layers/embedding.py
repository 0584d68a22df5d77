"""Token embedding and the LM head (its transpose, possibly tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Looks up ``[vocab, hidden]`` rows for token ids."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits, returned in float32 for the sampler."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding matrix (``tie_word_embeddings``): one tensor, not a copy."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (as HF does); only the result is upcast.
        return F.linear(hidden, self.weight).float()
