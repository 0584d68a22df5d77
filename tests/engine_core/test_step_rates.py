"""The placement inputs an engine reports: queued prefill tokens, prefill rate, step time."""

from __future__ import annotations

import pytest

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.step_rates import (
    StepRates,
    mixed_prefill_tokens,
    mixed_step_prefill_budget,
    prefill_rate_beside_decodes,
)


def test_averages_by_step_kind() -> None:
    rates = StepRates(weight=0.5, min_prefill_tokens=64)
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (0.0, 0.0)  # unmeasured
    assert rates.rate_beside_decodes == 0.0
    rates.observe(0.1, 1000, 4)       # nothing measured yet: decodes ride along
    assert rates.prefill_tokens_per_s == pytest.approx(10_000)
    rates.observe(0.1, 3000, 0)       # prefill alone: its own rate
    assert rates.prefill_alone_tokens_per_s == pytest.approx(30_000)
    assert rates.prefill_tokens_per_s == pytest.approx(10_000)
    rates.observe(0.01, 0, 8)         # decodes alone
    rates.observe(0.03, 0, 8)
    assert rates.decode_step_s == pytest.approx(0.02)
    rates.observe(0.0, 5000, 0)       # no time measured
    rates.observe(0.01, 32, 0)        # a small prefill alone: fixed costs dominate it
    assert (rates.prefill_alone_tokens_per_s, rates.decode_step_s) == (
        pytest.approx(30_000), pytest.approx(0.02))


def test_steps_without_decodes_keep_their_own_prefill_rate() -> None:
    rates = StepRates(weight=0.5, min_prefill_tokens=64)
    rates.observe(0.05, 2000, 0)      # a prompt alone: 40k tokens/s
    assert (rates.prefill_alone_tokens_per_s, rates.prefill_tokens_per_s) == (40_000, 0.0)
    # Until a mixed step measures the marginal rate, mixed steps are planned at this one.
    assert rates.rate_beside_decodes == 40_000
    assert mixed_step_prefill_budget(0.010, rates, 16, 8) == 400
    rates.observe(0.004, 0, 2)        # two decodes alone: a 4 ms decode part, all fixed
    # Mixed steps whose prefill is the larger part measure the marginal rate and leave the
    # rate of prefill alone: a 256-token chunk beside 2 decodes in 20 ms (the fixed part
    # hidden) is 12.8k tokens/s.
    for _ in range(8):
        rates.observe(0.020, 256, 2)
    assert rates.prefill_tokens_per_s == pytest.approx(12_800)
    assert rates.rate_beside_decodes == pytest.approx(12_800)
    assert rates.prefill_alone_tokens_per_s == 40_000
    rates.observe(0.006, 300, 0)      # a prompt alone within twice the fixed part
    assert rates.prefill_alone_tokens_per_s == 40_000
    rates.observe(0.025, 2000, 0)     # 80k: the average moves halfway
    assert rates.prefill_alone_tokens_per_s == pytest.approx(60_000)
    assert rates.prefill_tokens_per_s == pytest.approx(12_800)


def test_the_step_base_comes_from_steps_of_one_or_two_decodes_alone() -> None:
    rates = StepRates(weight=0.5)
    rates.observe(0.020, 0, 64)       # a full batch says nothing of the fixed part
    rates.observe(0.030, 2048, 1)     # nor a step with a prefill
    assert rates.decode_base_s == 0.0
    rates.observe(0.006, 0, 1)
    rates.observe(0.008, 0, 2)
    assert rates.decode_base_s == pytest.approx(0.007)
    rates.observe(0.050, 0, 3)
    assert rates.decode_base_s == pytest.approx(0.007)


def test_the_decode_part_of_any_batch_comes_from_its_growth_per_row() -> None:
    rates = StepRates(weight=0.5)
    rates.observe(0.006, 0, 16)       # no fixed part yet: no growth either
    assert (rates.decode_per_row_s, rates.decode_part_s(16)) == (0.0, 0.006)
    rates.observe(0.004, 0, 1)        # the fixed part: 4 ms at one row
    rates.observe(0.0055, 0, 16)      # 15 rows more: 0.1 ms a row
    assert rates.decode_per_row_s == pytest.approx(1e-4)
    # A worker that always has prompts to compute runs no step of decodes alone: its
    # decode part for 40 rows is predicted, not the stale average of smaller batches.
    for _ in range(5):
        rates.observe(0.012, 512, 40)
    assert rates.decode_per_row_s == pytest.approx(1e-4)
    assert rates.decode_part_s(40) == pytest.approx(0.0079)
    assert rates.decode_step_s == pytest.approx(0.00525)


def test_growth_learned_at_small_batches_predicts_large_ones() -> None:
    # A true step of 4 ms + 0.1 ms a row. The fixed part comes from steps of one and two
    # rows (4.15 ms at 1.5 rows on average); steps of three rows teach nothing, of four
    # the growth over the fixed part's own rows.
    rates = StepRates(weight=0.5)
    rates.observe(0.0041, 0, 1)
    rates.observe(0.0042, 0, 2)
    rates.observe(0.0043, 0, 3)
    assert rates.decode_per_row_s == 0.0
    rates.observe(0.0044, 0, 4)
    assert rates.decode_per_row_s == pytest.approx(1e-4)
    assert rates.decode_part_s(31) == pytest.approx(0.0071)


def test_mixed_steps_of_a_grown_batch_are_read_with_its_own_decode_part() -> None:
    # A 4.5 ms step at one row and 0.1 ms a row more, learned at 15 streams; then only
    # mixed steps of 31 decodes and 800 prompt tokens at 40k tokens/s: 7.5 ms of decodes,
    # 20 ms of prompt of which 4.5 hide the fixed part, 23 ms in all.
    rates = StepRates(weight=0.5)
    rates.observe(0.0045, 0, 1)
    rates.observe(0.0059, 0, 15)
    for _ in range(10):
        rates.observe(0.0230, 800, 31)
    assert rates.decode_part_s(31) == pytest.approx(0.0075)
    assert rates.prefill_tokens_per_s == pytest.approx(40_000, rel=1e-3)
    assert abs(rates.mixed_excess_s) < 1e-5
    # A 12 ms target at 31 decodes: 12 - 7.5 + 4.5 ms of prompt, 360 tokens (352 in blocks).
    assert mixed_step_prefill_budget(0.012, rates, 16, 31) == 352
    assert mixed_step_prefill_budget(0.012, rates, 16, 1) > 352


def test_with_the_fixed_part_measured_a_chunk_hides_it_and_overshoots_shrink_that() -> None:
    # Decode part 9 ms of which 6 ms is the weights' read; 40k prompt tokens/s.
    rates = StepRates(weight=0.5, prefill_tokens_per_s=40_000, decode_step_s=0.009,
                      decode_base_s=0.006)
    assert rates.hidden_s == pytest.approx(0.006)
    # A 12 ms target leaves 3 ms beside the decodes, plus the 6 ms a chunk hides: 360.
    assert mixed_prefill_tokens(0.012, 0.009, 40_000, rates.hidden_s) == pytest.approx(360)
    assert mixed_step_prefill_budget(0.012, rates, 16, 8) == 352
    # A 360-token mixed step predicted at 12 ms takes 14: the excess shrinks what is hidden,
    # and neither the rate (its chunk is short of twice the fixed part) nor the decode part
    # moves.
    rates.observe(0.014, 360, 8)
    assert rates.mixed_excess_s == pytest.approx(0.002)
    assert rates.hidden_s == pytest.approx(0.004)
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (40_000, 0.009)
    assert mixed_step_prefill_budget(0.012, rates, 16, 8) == 272
    # A long chunk measures the rate with the decode part's growth (3 ms) taken out.
    rates.observe(0.053, 2000, 8)
    assert rates.prefill_tokens_per_s == pytest.approx((40_000 + 40_000) / 2)


def test_a_prefill_under_the_weights_read_measures_no_rate() -> None:
    rates = StepRates(weight=0.5, decode_base_s=0.006, prefill_tokens_per_s=40_000)
    rates.observe(0.007, 128, 0)   # 128 tokens in 7 ms: the read, not the compute
    assert rates.prefill_tokens_per_s == 40_000
    rates.observe(0.050, 2000, 0)
    assert rates.prefill_tokens_per_s == pytest.approx(40_000)


def test_a_mixed_step_measures_its_larger_part() -> None:
    rates = StepRates(weight=0.5, prefill_tokens_per_s=20_000, decode_step_s=0.02)
    # 200 prompt tokens are predicted at 10 ms, less than the decode part: the step's
    # other 30 ms are its decodes (the decode part rises, which bounds the next step).
    rates.observe(0.040, 200, 8)
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (pytest.approx(20_000),
                                                                 pytest.approx(0.025))
    # 2000 tokens (100 ms predicted) dominate: the decode part is predicted, the rest
    # measures the rate (2000 tokens in 75 ms).
    rates.observe(0.100, 2000, 8)
    assert rates.decode_step_s == pytest.approx(0.025)
    assert rates.prefill_tokens_per_s == pytest.approx((20_000 + 2000 / 0.075) / 2)
    # A worker that measured only its decode part learns the rate from a mixed step.
    fresh = StepRates(decode_step_s=0.02)
    fresh.observe(0.070, 1000, 8)
    assert fresh.prefill_tokens_per_s == pytest.approx(20_000)


def test_mixed_prefill_tokens_and_the_rate_beside_decodes() -> None:
    assert mixed_prefill_tokens(0.012, 0.009, 40_000) == pytest.approx(120)
    assert mixed_prefill_tokens(0.012, 0.015, 40_000) == 0.0
    # With a target, a decoding worker prefills in the share its decodes leave.
    assert prefill_rate_beside_decodes(40_000, 0.009, 0.012) == pytest.approx(10_000)
    # Without one (or before its decode part is measured), at its full rate.
    assert prefill_rate_beside_decodes(40_000, 0.009, 0.0) == 40_000
    assert prefill_rate_beside_decodes(40_000, 0.0, 0.012) == 40_000


def test_engine_reports_queued_prompt_tokens_and_rates(tiny_checkpoint) -> None:
    engine = EngineCore(EngineConfig.from_kwargs(
        str(tiny_checkpoint("qwen3")), num_gpu_blocks_override=64, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("a", list(range(1, 151)), params, 0.0))
    engine.add_request(AddRequest("b", list(range(1, 41)), params, 0.0))
    assert engine.get_stats().num_prefill_tokens_queued == 190
    engine.step()  # a 64-token chunk of a
    assert engine.get_stats().num_prefill_tokens_queued == 126
    for _ in range(50):
        engine.step()
        if not engine.has_runnable():
            break
    stats = engine.get_stats()
    assert stats.num_prefill_tokens_queued == 0
    assert stats.prefill_alone_tokens_per_s > 0 and stats.decode_step_s > 0


def test_step_clock_hands_back_finished_steps_in_order() -> None:
    import torch

    from engine_core.worker.step_clock import StepClock

    clock = StepClock(torch.device("cpu"))
    assert clock.finished() == []
    for tokens, decodes in ((512, 0), (16, 8)):
        mark = clock.start()
        clock.stop(mark, tokens, decodes)
    costs = clock.finished()
    assert [(c.num_prefill_tokens, c.num_decodes) for c in costs] == [(512, 0), (16, 8)]
    assert all(c.seconds >= 0 for c in costs)
    assert clock.finished() == []  # each step once


def test_engine_rates_come_from_the_device_time_of_each_step(tiny_checkpoint,
                                                              monkeypatch) -> None:
    """The rates are fed by the runner's clock (a step's device time), not by the wall
    time of the call that collects it: here every forward is said to take 100 ms."""
    from engine_core.worker.step_clock import StepClock

    engine = EngineCore(EngineConfig.from_kwargs(
        str(tiny_checkpoint("qwen3")), num_gpu_blocks_override=64, max_num_batched_tokens=64))
    assert isinstance(engine.runner.step_clock, StepClock)
    real_stop = StepClock.stop

    def slow_stop(self, mark, num_prefill_tokens, num_decodes):  # a forward of 100 ms
        real_stop(self, mark, num_prefill_tokens, num_decodes)
        start, _, p, d = self._pending.pop()
        self._pending.append((start, start + 0.1, p, d))

    monkeypatch.setattr(StepClock, "stop", slow_stop)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("a", list(range(1, 129)), params, 0.0))
    for _ in range(20):
        engine.step()
        if not engine.has_runnable():
            break
    stats = engine.get_stats()
    assert stats.prefill_alone_tokens_per_s == pytest.approx(640.0)  # 64-token chunks, 100 ms
    assert stats.decode_step_s == pytest.approx(0.1)
