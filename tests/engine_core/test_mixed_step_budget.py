"""The decode-step target: a step with decodes takes only the prompt tokens that keep it
within the target (at least a block); steps without decodes, and schedulers without a
target, are unbounded. Pure scheduler checks (milliseconds) and one tiny-model run."""

from __future__ import annotations

import dataclasses

import pytest

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.errors import ConfigError
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from tests.engine_core.test_scheduler import (
    BLOCK,
    FakeRunner,
    assert_all_free,
    make_request,
    make_scheduler,
    run_until_idle,
)


def targeted(target_s: float | None, budget: int = 64, rate: float = 1000.0,
             decode_s: float = 0.010) -> Scheduler:
    """A scheduler with the target and these measured rates (prompt tokens/s, decode part)."""
    scheduler = make_scheduler(budget=budget, num_blocks=128)
    scheduler.config = dataclasses.replace(scheduler.config, decode_step_target_s=target_s)
    scheduler.step_rates.prefill_tokens_per_s = rate
    scheduler.step_rates.decode_step_s = decode_s
    return scheduler


def step(scheduler: Scheduler, runner: FakeRunner) -> dict[str, int]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    return dict(out.num_scheduled_tokens)


def start_decoding(scheduler: Scheduler, runner: FakeRunner) -> None:
    """Request ``d`` prefilled (a step without decodes: unbounded) and now decoding."""
    scheduler.add_request(make_request("d", 6, max_tokens=50))
    assert step(scheduler, runner) == {"d": 6}


def test_a_step_with_decodes_takes_what_the_target_leaves() -> None:
    # Target 31 ms, decode part 10 ms, 1000 prompt tokens/s: 21 tokens, 5 whole blocks of 4.
    scheduler, runner = targeted(0.031), FakeRunner()
    assert scheduler.mixed_prefill_budget() is None  # nothing decodes yet
    start_decoding(scheduler, runner)
    assert scheduler.mixed_prefill_budget() == 20
    scheduler.add_request(make_request("p", 50, start=100))
    assert step(scheduler, runner) == {"d": 1, "p": 20}
    assert step(scheduler, runner) == {"d": 1, "p": 20}  # the running chunk too
    # Two prefills share the step's prompt tokens; the second waits its turn.
    scheduler.add_request(make_request("q", 30, start=200))
    assert step(scheduler, runner) == {"d": 1, "p": 10, "q": 10}
    run_until_idle(scheduler, runner)
    assert_all_free(scheduler)


def test_at_least_one_block_when_the_decodes_fill_the_target() -> None:
    scheduler, runner = targeted(0.008, decode_s=0.012), FakeRunner()
    start_decoding(scheduler, runner)
    assert scheduler.mixed_prefill_budget() == BLOCK
    scheduler.add_request(make_request("p", 50, start=100))
    assert step(scheduler, runner) == {"d": 1, "p": BLOCK}
    # A one-token row is a decode, never held back by the prompt share (a landed load, a
    # prompt whose prefix was cached but for its last token).
    scheduler.add_request(make_request("one", 1, start=300))
    assert step(scheduler, runner) == {"d": 1, "p": BLOCK, "one": 1}


def test_steps_without_decodes_are_unbounded() -> None:
    scheduler, runner = targeted(0.030), FakeRunner()
    scheduler.add_request(make_request("p", 50, start=100))
    scheduler.add_request(make_request("q", 50, start=200))
    assert step(scheduler, runner) == {"p": 50, "q": 14}  # the token budget (64) only


def test_off_by_default_and_until_the_rate_is_measured() -> None:
    assert SchedulerConfig().decode_step_target_s is None
    for scheduler in (targeted(None), targeted(0.030, rate=0.0)):
        runner = FakeRunner()
        start_decoding(scheduler, runner)
        assert scheduler.mixed_prefill_budget() is None
        scheduler.add_request(make_request("p", 100, start=100))
        assert step(scheduler, runner) == {"d": 1, "p": 63}


def test_the_target_needs_chunked_prefill_and_a_positive_value() -> None:
    with pytest.raises(ConfigError, match="chunked"):
        SchedulerConfig(decode_step_target_s=0.01, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="decode-step-target"):
        SchedulerConfig(decode_step_target_s=0.0)


def _generate(checkpoint: str, **engine_kwargs: object) -> tuple[dict[str, list[int]],
                                                               list[dict[str, int]]]:
    """Greedy tokens of a short prompt that decodes while two long ones prefill beside it;
    with every step's scheduled tokens."""
    engine = EngineCore(EngineConfig.from_kwargs(
        checkpoint, num_gpu_blocks_override=128, max_num_batched_tokens=64,
        async_scheduling=False, **engine_kwargs))
    steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording():  # type: ignore[no-untyped-def]
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True).to_dict()
    tokens: dict[str, list[int]] = {}
    engine.add_request(AddRequest("short", list(range(3, 73)), params, 0.0))
    for _ in range(4):  # its prefill (measures the rate), decodes (the decode part)
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    engine.add_request(AddRequest("long1", [5 + i % 90 for i in range(170)], params, 0.0))
    engine.add_request(AddRequest("long2", [7 + i % 80 for i in range(150)], params, 0.0))
    for _ in range(200):
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if not engine.scheduler.has_unfinished():
            break
    return tokens, steps


def test_output_is_token_identical_with_the_target(tiny_checkpoint) -> None:
    checkpoint = str(tiny_checkpoint("qwen3"))
    want, unbounded = _generate(checkpoint)
    # A target below any step's decode part: each step with decodes takes one block (16).
    got, bounded = _generate(checkpoint, decode_step_target_s=1e-9)
    assert got == want and all(len(t) == 12 for t in got.values())
    prompt_rows = [sum(n for n in s.values() if n > 1) for s in bounded if 1 in s.values()]
    assert prompt_rows and max(prompt_rows) <= 16 and any(rows == 16 for rows in prompt_rows)
    assert max(sum(n for n in s.values() if n > 1) for s in unbounded) > 16


def test_the_engine_reports_its_target_and_its_decoding_requests(tiny_checkpoint) -> None:
    engine = EngineCore(EngineConfig.from_kwargs(
        str(tiny_checkpoint("qwen3")), num_gpu_blocks_override=64, max_num_batched_tokens=32,
        async_scheduling=False, decode_step_target_s=0.25))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("short", list(range(3, 13)), params, 0.0))
    engine.step()  # its whole prompt: it decodes from now on
    engine.add_request(AddRequest("long", list(range(3, 203)), params, 0.0))
    engine.step()  # a chunk of the long prompt: running, not decoding
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_decoding) == (2, 1)
    assert stats.decode_step_target_s == 0.25
