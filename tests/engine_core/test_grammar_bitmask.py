"""Packed bitmasks: row layout for a step, unpacking on the logits, the sampler applying
them before everything else, and the compile cache."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.grammar.bitmask import GrammarBitmask, apply_bitmask, num_words
from engine_core.sampling_params import SamplingParams
from engine_core.worker.sampler import Sampler, SamplingRow


def _pack(allowed: list[set[int]], vocab: int) -> np.ndarray:
    words = np.zeros((len(allowed), num_words(vocab)), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)


def test_apply_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    vocab = 70  # not a multiple of 32: the last word is cut
    allowed = [{0, 31, 32, 63, 69}, set(range(vocab))]
    logits = torch.randn(2, vocab)
    masked = apply_bitmask(logits, torch.from_numpy(_pack(allowed, vocab)))
    for row, tokens in enumerate(allowed):
        finite = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(masked[row, sorted(tokens)], logits[row, sorted(tokens)])


def test_rows_follow_the_step_order_and_others_allow_everything() -> None:
    words = _pack([{1}, {2}], 64)
    mask = GrammarBitmask(["b", "d"], words)
    rows = mask.for_rows(["a", "d", "b"])
    assert rows is not None
    assert (rows[0] == -1).all() and (rows[1] == words[1]).all() and (rows[2] == words[0]).all()
    assert mask.for_rows(["a", "c"]) is None


def test_sampler_never_draws_a_masked_token_whatever_the_bias() -> None:
    vocab, rows = 64, 32
    allowed = {5, 40}
    logits = torch.randn(rows, vocab)
    # The bias pushes a forbidden token up: the mask comes first and keeps it out.
    params = SamplingParams(temperature=1.0, top_k=3, logit_bias={7: 100.0})
    sample_rows = [SamplingRow(params, [1, 2], 2, (0,)) for _ in range(rows)]
    mask = torch.from_numpy(_pack([allowed] * rows, vocab))
    tokens, _ = Sampler().sample(logits, sample_rows, None, mask).read()
    assert set(tokens) <= allowed
    unmasked, _ = Sampler().sample(logits, sample_rows).read()
    assert not set(unmasked) <= allowed  # the bias wins without the mask


def test_compile_cache_shares_one_compile_per_spec(tmp_path, tiny_checkpoint) -> None:
    from engine_core.grammar.compiler import GrammarCompiler
    from engine_core.grammar.spec import GrammarSpec

    compiler = GrammarCompiler(str(tiny_checkpoint("llama")), 1024, (0,), max_cached=2)
    try:
        first = compiler.submit(GrammarSpec("regex", "a+"))
        assert compiler.submit(GrammarSpec("regex", "a+")) is first
        compiler.submit(GrammarSpec("regex", "b+"))
        compiler.submit(GrammarSpec("regex", "c+"))
        assert compiler.num_cached == 2
        assert compiler.submit(GrammarSpec("regex", "a+")) is not first  # evicted
        assert first.result(timeout=120) is not None
    finally:
        compiler.shutdown()
