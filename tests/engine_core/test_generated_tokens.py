"""A request continuing after output tokens sampled elsewhere (the first-token handoff).

The prefill worker samples the first token and the proxy streams it; the decode worker gets
the prompt plus that token as already generated. Its tokens from there on must be exactly
the uninterrupted request's: greedy, seeded sampling (draws keyed by output position) and
penalties (the handed-over token counts as output); a token that ends the request ends it
at once, with no step.
"""

from __future__ import annotations

import pytest

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.errors import InvalidRequestError
from engine_core.messages import AddRequest, EngineOutput
from engine_core.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 1000, 12, 64, 9, 300, 2, 18, 404, 33]


def _engine(tiny_checkpoint) -> EngineCore:
    path = str(tiny_checkpoint("qwen3"))
    return EngineCore(EngineConfig.from_kwargs(path, num_gpu_blocks_override=64))


def _run(engine: EngineCore, msg: AddRequest) -> tuple[list[int], list[EngineOutput]]:
    """All tokens the engine outputs for ``msg`` and its outputs, to the finish."""
    engine.add_request(msg)
    tokens: list[int] = []
    outputs: list[EngineOutput] = []
    for _ in range(200):
        for out in engine.step():
            if out.request_id == msg.request_id:
                outputs.append(out)
                tokens += out.new_token_ids
        if outputs and outputs[-1].finish_reason is not None:
            return tokens, outputs
    raise AssertionError("the request did not finish")


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12,
                             ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                repetition_penalty=1.5, frequency_penalty=0.8,
                                presence_penalty=0.5),
}


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_continuation_equals_the_uninterrupted_request(tiny_checkpoint, kind: str) -> None:
    params = SAMPLINGS[kind]
    engine = _engine(tiny_checkpoint)
    whole, _ = _run(engine, AddRequest("whole", PROMPT, params.to_dict(), 0.0))
    assert len(whole) == 12
    engine.reset_prefix_cache()
    rest, outputs = _run(engine, AddRequest("rest", PROMPT, params.to_dict(), 0.0,
                                            generated_token_ids=whole[:1]))
    assert rest == whole[1:]
    assert outputs[-1].finish_reason == "length"
    # A later token handed over too (several may be): the same tail.
    rest3, _ = _run(engine, AddRequest("rest3", PROMPT, params.to_dict(), 0.0,
                                       generated_token_ids=whole[:3]))
    assert rest3 == whole[3:]


def test_a_handed_over_token_that_ends_the_request_ends_it_at_once(tiny_checkpoint) -> None:
    engine = _engine(tiny_checkpoint)
    greedy = SAMPLINGS["greedy"]
    whole, _ = _run(engine, AddRequest("whole", PROMPT, greedy.to_dict(), 0.0))
    stop_at_first = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[whole[0]])
    tokens, outputs = _run(engine, AddRequest("stop", PROMPT, stop_at_first.to_dict(), 0.0,
                                              generated_token_ids=whole[:1]))
    assert tokens == [] and len(outputs) == 1
    assert (outputs[0].finish_reason, outputs[0].stop_reason) == ("stop", whole[0])
    # min_tokens counts the handed-over token: the stop token stays masked exactly as long
    # as in the uninterrupted request.
    held = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[whole[0], whole[1]],
                          min_tokens=3, ignore_eos=True)
    held_whole, _ = _run(engine, AddRequest("held-whole", PROMPT, held.to_dict(), 0.0))
    assert len(held_whole) >= 3
    tokens, _ = _run(engine, AddRequest("held", PROMPT, held.to_dict(), 0.0,
                                        generated_token_ids=held_whole[:1]))
    assert tokens == held_whole[1:]
    # max_tokens already reached: finished by length, nothing computed.
    one = SamplingParams(temperature=0.0, max_tokens=1)
    tokens, outputs = _run(engine, AddRequest("one", PROMPT, one.to_dict(), 0.0,
                                              generated_token_ids=whole[:1]))
    assert tokens == [] and outputs[-1].finish_reason == "length"
    assert not engine.has_work() and not engine.scheduler.requests


@pytest.mark.parametrize("generated,why", [([1 << 30], "generated token ids"),
                                           ([-1], "generated token ids"),
                                           ([1, 2, 3], "already generated")])
def test_bad_generated_tokens_are_refused(tiny_checkpoint, generated: list[int], why: str) -> None:
    engine = _engine(tiny_checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match=why):
        engine.add_request(AddRequest("bad", PROMPT, params.to_dict(), 0.0,
                                      generated_token_ids=generated))
    assert not engine.has_work()
