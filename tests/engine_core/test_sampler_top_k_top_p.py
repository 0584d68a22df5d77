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


def test_top_k_keeps_every_token_tied_with_the_kth():
    """vLLM and HF cut below the k-th value: tied tokens all stay, whatever the sort's order
    among equal values (bf16 logits tie often)."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0, -1.0]])
    assert _seen(logits, range(300), top_k=1) == {0, 1, 2}
    assert _seen(logits, range(300), top_k=2) == {0, 1, 2}
    assert _seen(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), range(300), top_k=2) == {0, 1, 2}


def test_min_p_comes_before_top_p():
    """vLLM V1's order (temperature, min_p, then top-k/top-p): top-p measures mass among the
    tokens min_p kept. Probabilities 0.5 and 0.3 on two tokens, 0.2 spread over 1000: min_p
    0.1 keeps the two (renormalised 0.625 / 0.375), so top_p 0.6 keeps token 0 alone; with
    top-p first, token 1 would stay."""
    probs = torch.full((1, 1002), 0.2 / 1000)
    probs[0, 0], probs[0, 1] = 0.5, 0.3
    assert _seen(probs.log(), range(300), min_p=0.1, top_p=0.6) == {0}


def test_rows_at_top_p_one_lose_no_token_beside_a_top_p_row():
    """A row with top_p 1 in a batch that takes the top-p pass keeps its whole distribution,
    however early the float cumsum reaches 1."""
    from engine_core.worker.sampler import _mask_top_k_top_p

    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 152064, generator=generator) * 4).sort(dim=-1, descending=True)[0]
    top_k = torch.full((2, 1), 152064.0)
    top_p = torch.tensor([[1.0], [0.5]])
    masked = _mask_top_k_top_p(logits, top_k, top_p)
    assert torch.isfinite(masked[0]).all()
    assert not torch.isfinite(masked[1]).all()
