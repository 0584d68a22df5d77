"""Structured outputs under async scheduling: a constrained step is launched while the step
before is in flight, its masks are filled once that step's tokens advanced the grammars,
and every token is the one one-step-at-a-time scheduling samples (seeded and greedy rows,
constrained and not, in one batch). On a GPU machine these run on CUDA with graphs, the
pinned staging and the Triton apply."""

from __future__ import annotations

import json
import re
import threading

import pytest

from engine_core.grammar.spec import grammar_spec
from engine_core.llm import LLM
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                            "maxItems": 4}},
    "required": ["id", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-\d{1,4}"
CHOICES = ("red", "green", "a long blue")
CACHE = {"kv_cache_memory_bytes": 32 << 20}


def _params() -> list[SamplingParams]:
    constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
                   StructuredOutputsParams(choice=CHOICES), None]
    params = []
    for i in range(16):
        sampling = (dict(temperature=0.0) if i % 3 == 0
                    else dict(temperature=1.0, top_k=40, seed=1000 + i))
        if i % 5 == 1:
            sampling.update(repetition_penalty=1.2, logprobs=2)
        params.append(SamplingParams(max_tokens=48, structured_outputs=constraints[i % 4],
                                     **sampling))
    return params


def _run(path, prompts, params, async_scheduling: bool):
    llm = LLM(str(path), async_scheduling=async_scheduling, max_model_len=256, **CACHE)
    try:
        # Compiled before the requests arrive: a request waits for its compile, so compiles
        # finishing at different steps would batch the two runs differently.
        for p in params:
            if p.structured_outputs is not None:
                llm.engine.grammars.submit(grammar_spec(p.structured_outputs)).result()
        outputs = llm.generate(prompts, params)
        manager = llm.engine.kv_manager
        assert manager.num_free_blocks == manager.num_total_blocks
        return ([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                 for o in outputs], llm.engine.masked_steps)
    finally:
        llm.shutdown()


def test_async_equals_sync_with_constrained_rows_and_keeps_the_overlap(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = [f"item {i}: describe it" for i in range(16)]
    params = _params()
    sync, sync_steps = _run(path, prompts, params, async_scheduling=False)
    asynchronous, async_steps = _run(path, prompts, params, async_scheduling=True)
    for i, (a, s) in enumerate(zip(asynchronous, sync)):
        assert a == s, f"request {i} ({params[i].structured_outputs}): {a} != {s}"
    for (_, text, reason), p in zip(sync, params):
        constraint = p.structured_outputs
        if constraint is None or reason != "stop":
            continue
        if constraint.json is not None:
            json.loads(text)
        elif constraint.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
    assert any(reason == "stop" for _, _, reason in sync)  # grammars ended requests
    # The same masked steps; with async scheduling all but those launched with nothing in
    # flight filled their masks while the step before ran.
    assert sync_steps.total == async_steps.total > 10
    assert sync_steps.overlapped == 0
    assert async_steps.overlapped >= async_steps.total - 2


def test_one_constrained_request_overlaps_every_step_but_its_first(tiny_checkpoint):
    """A lone constrained request: its prefill step has nothing in flight, every later
    masked step is launched before the step before it is collected. A step scheduled for
    it while the token that completes its grammar is in flight samples without a mask (the
    token is dropped) and is not counted."""
    llm = LLM(str(tiny_checkpoint("llama")), max_model_len=256, **CACHE)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=64,
                                structured_outputs=StructuredOutputsParams(regex=REGEX))
        engine.add_request(AddRequest("r", [5, 6, 7, 8], params.to_dict(), 0.0))
        tokens, reason = [], None
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
                reason = out.finish_reason or reason
        assert reason == "stop" and len(tokens) > 3
        assert engine.masked_steps.total == len(tokens)
        assert engine.masked_steps.overlapped == len(tokens) - 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_grammar_ending_with_a_step_in_flight_leaks_nothing(tiny_checkpoint,
                                                              async_scheduling):
    """Choice grammars end after a few tokens, while the next step (holding the request) is
    already launched: the request ends with a choice, and no block stays held."""
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=async_scheduling,
              max_model_len=256, **CACHE)
    try:
        params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=16,
                                structured_outputs=StructuredOutputsParams(choice=CHOICES))
        outputs = llm.generate(["pick one"], params)
        texts = [c.text for c in outputs[0].outputs]
        assert set(texts) <= set(CHOICES)
        assert all(c.finish_reason == "stop" for c in outputs[0].outputs)
        manager = llm.engine.kv_manager
        manager.check_integrity()
        assert manager.num_free_blocks == manager.num_total_blocks
        assert not llm.engine.has_work()
    finally:
        llm.shutdown()


def test_the_masks_fill_while_the_next_step_is_scheduled(tiny_checkpoint, monkeypatch):
    """A step's masks fill on the filler's thread after ``step`` returns: each fill can
    finish only once a schedule has run after it started (the next call's), and that call
    queues the sampling before its launch. Filling inside ``step`` would wait forever."""
    import engine_core.worker.masked_sampling as masked_sampling
    from engine_core.grammar.bitmask import BitmaskFiller

    schedules = threading.Condition()
    counts = {"schedules": 0, "fills": 0}

    class GatedFiller(BitmaskFiller):
        def __init__(self) -> None:
            super().__init__(max_threads=2)
            batch, self.started_after = self._batch, 0

            class Gated:
                def batch_fill_next_token_bitmask(gated, *args, **kwargs) -> None:
                    with schedules:
                        assert schedules.wait_for(
                            lambda: counts["schedules"] > self.started_after, timeout=30), \
                            "the fill needed the next schedule to finish"
                    batch.batch_fill_next_token_bitmask(*args, **kwargs)
                    counts["fills"] += 1

            self._batch = Gated()

        def start(self, masks, out):
            self.started_after = counts["schedules"]
            return super().start(masks, out)

    monkeypatch.setattr(masked_sampling, "BitmaskFiller", GatedFiller)
    llm = LLM(str(tiny_checkpoint("llama")), max_model_len=256, **CACHE)
    try:
        engine = llm.engine
        schedule = engine.scheduler.schedule

        def counted_schedule():
            output = schedule()
            with schedules:
                counts["schedules"] += 1
                schedules.notify_all()
            return output

        engine.scheduler.schedule = counted_schedule
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=32,
                                structured_outputs=StructuredOutputsParams(regex=REGEX))
        engine.add_request(AddRequest("r", [5, 6, 7, 8], params.to_dict(), 0.0))
        tokens, awaited = [], 0
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
            awaited += engine.masked_sampling.awaiting
        text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
        assert re.fullmatch(REGEX, text), text
        assert awaited == engine.masked_steps.total == counts["fills"] == len(tokens) > 3
    finally:
        llm.shutdown()
