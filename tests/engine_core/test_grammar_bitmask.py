"""Packed bitmasks: the torch apply on the logits (in place), the staging buffer, the
batched xgrammar fill into chosen rows, the sampler applying masks before everything else,
and the compile cache. The Triton apply is checked against the torch one in
test_triton_kernels.py."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.grammar.bitmask import apply_bitmask, num_words
from engine_core.sampling_params import SamplingParams
from engine_core.worker.grammar_mask import GrammarMaskStage
from engine_core.worker.sampler import Sampler, SamplingRow


def _pack(allowed: list[set[int]], vocab: int) -> np.ndarray:
    words = np.zeros((len(allowed), num_words(vocab)), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)


def test_apply_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    vocab = 70  # not a multiple of 32: the last word is cut
    allowed = [{0, 31, 32, 63, 69}, set(range(vocab)), set()]
    logits = torch.randn(3, vocab)
    original = logits.clone()
    masked = apply_bitmask(logits, torch.from_numpy(_pack(allowed, vocab)))
    assert masked is logits  # in place
    for row, tokens in enumerate(allowed):
        finite = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(masked[row, sorted(tokens)], original[row, sorted(tokens)])


def test_mask_stage_hands_out_its_first_rows() -> None:
    stage = GrammarMaskStage(max_rows=4, vocab_size=70, device=torch.device("cpu"))
    rows = stage.host_rows(2)
    assert rows.shape == (2, num_words(70)) and rows.dtype == torch.int32
    rows.fill_(5)
    on_device = stage.to_device(2)
    assert on_device.shape == (2, 3) and (on_device == 5).all()
    assert stage.host_rows(4).data_ptr() == rows.data_ptr()  # one buffer, reused


def test_batched_fill_writes_the_rows_it_is_given(tiny_checkpoint) -> None:
    from engine_core.grammar.bitmask import BitmaskFiller, StepMasks
    from engine_core.grammar.compiler import GrammarCompiler
    from engine_core.grammar.spec import GrammarSpec

    compiler = GrammarCompiler(str(tiny_checkpoint("llama")), 1024, (0,))
    try:
        import xgrammar as xgr

        compiled = compiler.submit(GrammarSpec("regex", "ab+")).result(timeout=120)
        fresh, advanced = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
        single = torch.zeros(2, num_words(1024), dtype=torch.int32)
        fresh.fill_next_token_bitmask(single, 0)
        assert advanced.accept_string("a")
        advanced.fill_next_token_bitmask(single, 1)
        assert not torch.equal(single[0], single[1])
        filler = BitmaskFiller(max_threads=2)
        for count in (1, 5):
            # One matcher per row, as each request has its own (threads fill them at once).
            matchers = []
            for _ in range(count):
                step = xgr.GrammarMatcher(compiled)
                assert step.accept_string("a")
                matchers += [step, xgr.GrammarMatcher(compiled)]
            expected = [single[1], single[0]] * count
            rows = [r for r in reversed(range(len(matchers) + 1)) if r != 1]
            out = torch.full((len(matchers) + 2, num_words(1024)), 9, dtype=torch.int32)
            job = filler.start(StepMasks(matchers, rows, len(matchers) + 1), out)
            assert job.wait() >= 0.0
            for want, row in zip(expected, rows, strict=True):
                assert torch.equal(out[row], want)
            assert (out[1] == -1).all()  # a row of the step without a matcher: all ones
            assert (out[-1] == 9).all()  # a row past the step is left alone
        filler.shutdown()
    finally:
        compiler.shutdown()


def test_sampler_never_draws_a_masked_token_whatever_the_bias() -> None:
    vocab, rows = 64, 32
    allowed = {5, 40}
    logits = torch.randn(rows, vocab)
    # The bias pushes a forbidden token up: the mask comes first and keeps it out.
    params = SamplingParams(temperature=1.0, top_k=3, logit_bias={7: 100.0})
    sample_rows = [SamplingRow(params, [1, 2], 2, (0,)) for _ in range(rows)]
    mask = torch.from_numpy(_pack([allowed] * rows, vocab))
    tokens, _ = Sampler().sample(logits.clone(), sample_rows, None, mask).read()
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
