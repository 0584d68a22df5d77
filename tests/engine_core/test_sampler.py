"""Sampler: greedy, top-k/top-p/min-p masks, penalties, seeded reproducibility, logprobs."""

from __future__ import annotations

import torch

from engine_core.sampling_params import SamplingParams
from engine_core.worker.sampler import Sampler, SamplingRow


def rows(*params: SamplingParams, outputs: list[int] | None = None) -> list[SamplingRow]:
    return [SamplingRow(p, [1, 2, 3] + list(outputs or []), 3, (0,)) for p in params]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = Sampler()(logits, rows(*[SamplingParams(temperature=0.0)] * 4))
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    tokens, _ = Sampler()(logits, rows(*[SamplingParams(temperature=1.3, top_k=1)] * 8))
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_sampling_reproducible_and_batch_independent():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=42)
    first, _ = Sampler()(logits, rows(seeded, seeded, SamplingParams(temperature=1.0)))
    alone, _ = Sampler()(logits[1:2], rows(seeded))
    assert first[0] == Sampler()(logits[0:1], rows(seeded))[0][0]
    assert first[1] == alone[0]
    # A different output position draws different noise.
    draws = {Sampler()(logits[0:1], rows(seeded, outputs=[5] * k))[0][0] for k in range(30)}
    assert len(draws) > 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[10.0, 9.0, -5.0, -5.0, -5.0]])
    params = SamplingParams(temperature=1.0, top_p=0.5)
    seen = {Sampler()(logits, rows(params))[0][0] for _ in range(50)}
    assert seen == {0}


def test_min_p_and_top_k_mask_tail():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 0.0, 0.0]])
    for params in (SamplingParams(temperature=1.0, min_p=0.5),
                   SamplingParams(temperature=1.0, top_k=2)):
        seen = {Sampler()(logits, rows(params))[0][0] for _ in range(100)}
        assert seen <= {0, 1}


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.full((1, 10), -10.0)
    logits[0, 0] = 10.0   # eos
    logits[0, 7] = 9.0    # stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    tokens, _ = Sampler()(logits, rows(params, outputs=[4]))
    assert tokens[0] not in (0, 7)
    tokens, _ = Sampler()(logits, rows(params, outputs=[4, 4]))
    assert tokens[0] == 0


def test_penalties_push_away_repeated_tokens():
    # Tokens 1-3 are the prompt; 0 and 4 are not.
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0, 2.9]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert Sampler()(logits, rows(params, outputs=[0]))[0] == [4]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, rows(params, outputs=[0]))[0] == [4]
    assert Sampler()(logits, rows(SamplingParams(temperature=0.0)))[0] == [0]


def test_penalties_equal_their_definition_and_upload_each_prompt_once():
    """vLLM's penalties, row by row: repetition over prompt and output tokens (divide a
    positive logit, multiply a negative one), frequency by output count, presence by output
    membership. A request's prompt reaches the device once (PromptTokens) however many
    steps it samples."""
    from engine_core.worker.sampler import PromptTokens

    generator = torch.Generator().manual_seed(2)
    vocab = 50
    logits = torch.randn(3, vocab, generator=generator) * 3
    prompts = [[1, 2, 2, 7, 9], [3, 3, 4], [5, 6]]
    outputs = [[7, 7, 11], [4, 12, 12, 12], [6]]
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3),
              SamplingParams(presence_penalty=0.9, frequency_penalty=-0.4),
              SamplingParams(repetition_penalty=1.3)]
    holders = [PromptTokens() for _ in prompts]
    rows = [SamplingRow(p, prompt + out, len(prompt), (0,), prompt_tokens=h)
            for p, prompt, out, h in zip(params, prompts, outputs, holders)]
    expected = logits.clone()
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        for token in set(prompt) | set(out):
            value = expected[i, token]
            expected[i, token] = (value / p.repetition_penalty if value > 0
                                  else value * p.repetition_penalty)
        for token in set(out):
            expected[i, token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
    got = Sampler._apply_penalties(logits, rows)
    torch.testing.assert_close(got, expected)
    uploaded = [h.tensor for h in holders]
    assert uploaded[1] is None  # no repetition penalty: the prompt is not needed
    assert sorted(uploaded[0].tolist()) == [1, 2, 7, 9]
    torch.testing.assert_close(Sampler._apply_penalties(logits, rows), expected)
    assert all(h.tensor is u for h, u in zip(holders, uploaded))
    # Async scheduling: each request's last output token still pending, read from the
    # in-flight step's samples at its row there, gives the same penalties.
    in_flight = torch.tensor([0, 6, 12, 11, 0])  # rows 3, 2 and 1 of that step
    pending = [SamplingRow(p, prompt + out[:-1], len(prompt), (0,), num_pending=1,
                           pending_index=at, prompt_tokens=h)
               for p, prompt, out, h, at in zip(params, prompts, outputs, holders, (3, 2, 1))]
    torch.testing.assert_close(Sampler._apply_penalties(logits, pending, in_flight), expected)


def test_logprobs_of_sampled_token_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    _, lps = Sampler()(logits, rows(SamplingParams(temperature=0.0, logprobs=2)))
    expected = torch.log_softmax(logits, -1)[0]
    lp = lps[0]
    assert lp.token_id == 1 and lp.rank == 1
    assert abs(lp.logprob - expected[1].item()) < 1e-6
    assert lp.top_token_ids == [1, 2]


def test_logprob_rank_counts_ties_as_vllm_does():
    """Rank = tokens whose logprob is at least the chosen one's (vLLM): a token tied with
    another is rank 2, not 1."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2)
    _, logprobs = Sampler()(logits, rows(params))
    assert logprobs[0].token_id == 0 and logprobs[0].rank == 2
    _, logprobs = Sampler()(torch.tensor([[3.0, 2.0, 2.0]]), rows(params))
    assert logprobs[0].rank == 1


def test_logit_bias_is_added_per_request_before_sampling():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(9))
    top = logits.argmax(-1).tolist()
    banned = SamplingParams(temperature=0.0, logit_bias={top[0]: -100.0})
    favoured = SamplingParams(temperature=0.0, logit_bias={5: 100.0, 6: 50.0})
    plain = SamplingParams(temperature=0.0)
    tokens, _ = Sampler()(logits, rows(banned, favoured, plain))
    second = logits[0].clone()
    second[top[0]] = float("-inf")
    assert tokens == [int(second.argmax()), 5, top[2]]  # the unbiased row is untouched
    # An exact sum, not a clamp: a small bias moves the choice only where it is enough.
    gap = float(logits[2, top[2]] - logits[2, 7])
    nudged = SamplingParams(temperature=0.0, logit_bias={7: gap + 0.01})
    assert Sampler()(logits[2:3], rows(nudged))[0] == [7]
    short = SamplingParams(temperature=0.0, logit_bias={7: gap - 0.01})
    assert Sampler()(logits[2:3], rows(short))[0] == [top[2]]
    # min_tokens still masks a stop token however strongly it is favoured.
    held = SamplingParams(temperature=0.0, logit_bias={0: 100.0}, min_tokens=1)
    assert Sampler()(logits[0:1], rows(held))[0][0] != 0


def test_allowed_token_ids_mask_everything_else_per_request():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    allowed = [3, 7, 21]
    only = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    plain = SamplingParams(temperature=0.0)
    tokens, _ = Sampler()(logits, rows(only, plain))
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert tokens == [best, int(logits[1].argmax())]
    sampled = {Sampler()(logits[0:1], rows(SamplingParams(temperature=2.0,
                                                          allowed_token_ids=allowed)))[0][0]
               for _ in range(60)}
    assert sampled <= set(allowed) and len(sampled) > 1
