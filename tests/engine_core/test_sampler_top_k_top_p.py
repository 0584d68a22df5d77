"""top-k then top-p: the nucleus is measured in what top-k left, renormalised (vLLM, HF).

Measured over the whole vocabulary, a top-k cut leaves less mass before each token, so
top-p kept tokens that vLLM and HF transformers never sample.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from engine_core.sampling_params import SamplingParams
from engine_core.worker.sampler import Sampler, SamplingRow


def _row(params: SamplingParams) -> SamplingRow:
    return SamplingRow(params, [1, 2, 3], 3, (0,))


def _seen(logits: torch.Tensor, seeds: range, **params) -> set[int]:
    return {Sampler()(logits, [_row(SamplingParams(temperature=1.0, seed=s, **params))])[0][0]
            for s in seeds}


def test_top_p_applies_to_the_top_k_distribution():
    # top_k=2 leaves [0.4, 0.3] -> [0.57, 0.43]: top_p=0.5 keeps token 0 alone.
    logits = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1]]).log()
    assert _seen(logits, range(300), top_k=2, top_p=0.5) == {0}


def test_kept_tokens_match_hf_warpers():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=generator) * 2
    for top_k, top_p in [(3, 0.6), (5, 0.7), (10, 0.9), (2, 0.95)]:
        hf = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
        for row in range(logits.shape[0]):
            allowed = set(torch.nonzero(hf[row] > float("-inf")).flatten().tolist())
            seen = _seen(logits[row:row + 1], range(200), top_k=top_k, top_p=top_p)
            assert seen <= allowed, (top_k, top_p, row, seen - allowed)
