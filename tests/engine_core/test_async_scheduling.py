"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read.

The outputs must be exactly those of one-step-at-a-time scheduling whatever the sampling
options (seeded sampling, min_tokens, stop tokens, penalties, logprobs, max_tokens of 1),
requests that stop, are aborted or preempted while a step is in flight must not get a
stray token, and a new request reusing a finished one's id must not inherit the stale one.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.messages import AddRequest

# A fixed cache size: several engines live in one test, and on a GPU each would otherwise
# size its cache to most of the card.
CACHE = {"kv_cache_memory_bytes": 32 << 20}


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.choice([1, 5, 16, 17, 40, 90]))]
            for _ in range(count)]


def _mixed_params(seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    params = []
    for i in range(24):
        kind = i % 8
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12)))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=9))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.7, top_p=0.8, seed=200 + i,
                                         min_tokens=4, max_tokens=8))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=10, logprobs=3))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.0, max_tokens=10,
                                         repetition_penalty=1.3, frequency_penalty=0.2))
        elif kind == 5:
            params.append(SamplingParams(temperature=0.0, max_tokens=1))
        elif kind == 6:
            # Stops on a token it is likely to produce: its own greedy pick is unknown, so
            # stop on a spread of ids; whichever comes first ends it.
            params.append(SamplingParams(temperature=0.0, max_tokens=12,
                                         stop_token_ids=list(range(0, 1000, 7))))
        else:
            params.append(SamplingParams(temperature=1.0, seed=300 + i, max_tokens=6,
                                         presence_penalty=0.5))
    return params


def _run(path, prompts, params, **engine_args):
    llm = LLM(str(path), **{**CACHE, **engine_args})
    outputs = llm.generate(prompts, params)
    manager = llm.engine.kv_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks
    assert not llm.engine.has_work()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in outputs]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 32},
    {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 64},
], ids=["default", "chunked", "preempting"])
def test_async_equals_sync_for_every_sampling_option(tiny_checkpoint, engine_args):
    path = tiny_checkpoint("qwen3")
    prompts = _prompts(24, seed=3)
    params = _mixed_params(seed=4)
    sync = _run(path, prompts, params, async_scheduling=False, **engine_args)
    asynchronous = _run(path, prompts, params, async_scheduling=True, **engine_args)
    for i, (a, s) in enumerate(zip(asynchronous, sync)):
        assert a[0] == s[0], f"request {i} ({params[i]}): {a[0]} != {s[0]}"
        assert a[1] == s[1], f"request {i}: finish reason {a[1]} != {s[1]}"
        if s[2] is not None:
            assert [e.logprob for e in a[2]] == pytest.approx([e.logprob for e in s[2]])
    # The stop-token requests really stopped early, and max_tokens=1 gave one token.
    assert any(reason == "stop" for _, reason, _ in sync)
    assert all(len(out[0]) == 1 for out, p in zip(sync, params) if p.max_tokens == 1)


def _engine(path, **engine_args):
    return LLM(str(path), **CACHE, **engine_args).engine


def _add(engine, request_id, prompt, **params):
    engine.add_request(AddRequest(request_id, prompt,
                                  SamplingParams(**params).to_dict(), 0.0))


def _tokens_until_done(engine, request_id):
    tokens, reason = [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
    return tokens, reason


def test_steps_overlap_and_outputs_trail_by_one(tiny_checkpoint):
    """In steady decode a step is left in flight; the host launches the next one before
    collecting it, and the launch order is launch N+1, collect N."""
    engine = _engine(tiny_checkpoint("llama"))
    calls: list[str] = []
    launch, collect = engine.runner.launch, engine.runner.collect
    engine.runner.launch = lambda out: (calls.append("launch"), launch(out))[1]
    engine.runner.collect = lambda step: (calls.append("collect"), collect(step))[1]
    _add(engine, "a", [5, 6, 7], temperature=0.0, max_tokens=6, ignore_eos=True)
    first = engine.step()  # prefill launched; nothing collected yet
    assert first == [] and engine.has_work()
    assert calls == ["launch"]
    tokens = []
    for _ in range(5):
        for out in engine.step():
            tokens += out.new_token_ids
        assert calls[-2:] == ["launch", "collect"]
    assert len(tokens) == 5
    rest, reason = _tokens_until_done(engine, "a")
    assert len(tokens + rest) == 6 and reason == "length"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_penalties_overlap_and_count_the_token_in_flight(tiny_checkpoint):
    """Penalties read the in-flight step's token on the device: a request with them
    overlaps its steps like any other, and its tokens are those of one-step-at-a-time
    scheduling (repeated tokens penalised, the pending one included)."""
    path = tiny_checkpoint("llama")
    engine = _engine(path)
    overlapped: list[bool] = []
    launch = engine.runner.launch

    def spy(out):
        if not out.is_empty:
            overlapped.append(engine._in_flight is not None)
        return launch(out)

    engine.runner.launch = spy
    penalties = dict(repetition_penalty=1.8, frequency_penalty=1.5, presence_penalty=1.0)
    _add(engine, "p", [5, 6, 7], temperature=0.0, max_tokens=12, ignore_eos=True, **penalties)
    tokens, _ = _tokens_until_done(engine, "p")
    assert len(tokens) == 12
    assert overlapped == [False] + [True] * 11
    sync = _engine(path, async_scheduling=False)
    _add(sync, "p", [5, 6, 7], temperature=0.0, max_tokens=12, ignore_eos=True, **penalties)
    want, _ = _tokens_until_done(sync, "p")
    assert tokens == want
    _add(sync, "q", [5, 6, 7], temperature=0.0, max_tokens=12, ignore_eos=True)
    plain, _ = _tokens_until_done(sync, "q")
    assert plain != want  # the penalties changed the greedy tokens


def test_abort_with_a_step_in_flight_gets_no_more_tokens(tiny_checkpoint):
    engine = _engine(tiny_checkpoint("qwen3"))
    _add(engine, "x", [9, 10, 11, 12], temperature=0.0, max_tokens=50, ignore_eos=True)
    _add(engine, "y", [3, 4], temperature=0.0, max_tokens=5, ignore_eos=True)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_requests(["x"])
    seen_after_abort = []
    finished = False
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "x":
                assert not finished, "output after the abort's final output"
                seen_after_abort += out.new_token_ids
                finished = finished or out.finish_reason is not None
    assert finished and seen_after_abort == []
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_reused_id_does_not_get_the_stale_token(tiny_checkpoint):
    """A request stops while the next step (holding it) is in flight; a new request with
    the same id is added at once: it must produce exactly what it produces alone."""
    path = tiny_checkpoint("qwen3")
    alone = _engine(path)
    _add(alone, "r", [40, 41, 42], temperature=0.0, max_tokens=4, ignore_eos=True)
    expected, _ = _tokens_until_done(alone, "r")

    # A stop token (unlike max_tokens) is only seen when the tokens are read, so the step
    # after the stopping one already holds the request.
    probe = _engine(path)
    _add(probe, "r", [7, 8, 9, 10, 11], temperature=0.0, max_tokens=3, ignore_eos=True)
    first_run, _ = _tokens_until_done(probe, "r")
    engine = _engine(path)
    _add(engine, "r", [7, 8, 9, 10, 11], temperature=0.0, max_tokens=20, ignore_eos=True,
         stop_token_ids=[first_run[1]])
    _add(engine, "other", [1, 2], temperature=0.0, max_tokens=12, ignore_eos=True)
    done = False
    while not done:
        for out in engine.step():
            done = done or (out.request_id == "r" and out.finish_reason is not None)
    assert engine._in_flight is not None
    assert "r" in engine._in_flight[0].num_scheduled_tokens
    _add(engine, "r", [40, 41, 42], temperature=0.0, max_tokens=4, ignore_eos=True)
    got, reason = _tokens_until_done(engine, "r")
    assert got == expected and reason == "length"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
