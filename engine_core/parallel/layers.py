"""Sharded layers: column- and row-parallel projections, vocabulary-parallel embedding and
LM head (Megatron's split; one all-reduce after attention's o_proj and one after the MLP's
down_proj, an all-gather of the logits).

Each layer says which slice of a checkpoint tensor it holds through
``checkpoint_shard(param_name, part)``; the loader cuts tensors with it. In a group of one
rank every layer is its unsharded base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core.layers.embedding import LMHead, VocabEmbedding
from engine_core.layers.linear import Linear, MergedLinear
from engine_core.parallel.group import TensorParallelGroup
from engine_core.parallel.sharding import Shard, padded_vocab_per_rank


class ColumnParallelLinear(MergedLinear):
    """Stacked projections whose output rows are split across ranks: each rank computes its
    ``part_shards[i]`` rows of part i (no communication; the next layer takes the shards)."""

    def __init__(self, in_features: int, part_shards: tuple[Shard, ...],
                 part_names: tuple[str, ...], bias: bool = False, gemv_max_rows: int = 0,
                 pdl: bool = True) -> None:
        super().__init__(in_features, tuple(s.size for s in part_shards), part_names, bias,
                         gemv_max_rows, pdl)
        self.part_shards = part_shards

    def checkpoint_shard(self, param_name: str, part: int | None) -> Shard | None:
        return None if part is None else self.part_shards[part]


class RowParallelLinear(Linear):
    """A projection whose input columns are split across ranks: partial products summed by
    one all-reduce, then the (replicated) bias added once."""

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup,
                 bias: bool = False, gemv_max_rows: int = 0, transposed: bool = False,
                 pdl: bool = True) -> None:
        local_in = in_features // group.size
        super().__init__(local_in, out_features, bias, gemv_max_rows, transposed, pdl)
        self.group = group
        self.in_shard = Shard(1, group.rank * local_in, local_in)

    def checkpoint_shard(self, param_name: str, part: int | None) -> Shard | None:
        return self.in_shard if param_name == "weight" and self.group.is_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.group.is_parallel:
            return super().forward(x)
        if self.takes_gemv(x):
            from engine_core.kernels.gemv import gemv

            out = gemv(x, self.weight, None, pdl=self.pdl)
        else:
            out = F.linear(x, self.weight)
        out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """Each rank holds a contiguous range of the (padded) vocabulary's rows; ids outside it
    look up zeros, and the all-reduce adds the one rank's row that holds each id."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        rows = padded_vocab_per_rank(vocab_size, group.size)
        super().__init__(rows, hidden_size)
        self.group = group
        self.shard = Shard(0, group.rank * rows, rows)

    def checkpoint_shard(self, param_name: str, part: int | None) -> Shard | None:
        return self.shard if self.group.is_parallel else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.group.is_parallel:
            return super().forward(input_ids)
        local = input_ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.size)
        hidden = F.embedding(local.clamp(0, self.shard.size - 1), self.weight)
        hidden = hidden * inside.unsqueeze(-1).to(hidden.dtype)
        return self.group.all_reduce(hidden)


class ParallelLMHead(LMHead):
    """The LM head over this rank's vocabulary rows; logits all-gathered to the full
    vocabulary (float32) on every rank, the padding cut off."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup,
                 gemv_max_rows: int = 0, pdl: bool = True) -> None:
        rows = padded_vocab_per_rank(vocab_size, group.size)
        super().__init__(rows, hidden_size, gemv_max_rows, pdl)
        self.vocab_size = vocab_size
        self.group = group
        self.shard = Shard(0, group.rank * rows, rows)

    def checkpoint_shard(self, param_name: str, part: int | None) -> Shard | None:
        return self.shard if self.group.is_parallel else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if not self.group.is_parallel:
            return logits
        return self.group.all_gather_last_dim(logits)[:, :self.vocab_size].contiguous()
