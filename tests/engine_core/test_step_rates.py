"""The placement inputs an engine reports: queued prefill tokens, prefill rate, step time."""

from __future__ import annotations

import pytest

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.step_rates import StepRates


def test_averages_by_step_kind() -> None:
    rates = StepRates(weight=0.5, min_prefill_tokens=64)
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (0.0, 0.0)  # unmeasured
    rates.observe(0.1, 1000, 4)       # a prefill step (decodes ride along)
    assert rates.prefill_tokens_per_s == pytest.approx(10_000)
    rates.observe(0.1, 3000, 0)
    assert rates.prefill_tokens_per_s == pytest.approx(20_000)  # halfway to 30k
    rates.observe(0.01, 0, 8)         # decodes alone
    rates.observe(0.03, 0, 8)
    assert rates.decode_step_s == pytest.approx(0.02)
    rates.observe(0.5, 10, 8)         # a small prefill: neither average moves
    rates.observe(0.0, 5000, 0)       # no time measured
    assert (rates.prefill_tokens_per_s, rates.decode_step_s) == (pytest.approx(20_000),
                                                                 pytest.approx(0.02))


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
    assert stats.prefill_tokens_per_s > 0 and stats.decode_step_s > 0
