"""Scheduler rules for requests with a grammar: they wait while it compiles, a failed
compile ends them with an error (no blocks held), an abort finds them, a grammar that
completes ends them as a stop, and a pending token does not keep them out of the next step
(async scheduling): their masks are filled once that token is collected."""

from __future__ import annotations

import pytest

from engine_core.request import RequestStatus
from tests.engine_core.test_scheduler import FakeRunner, make_request, make_scheduler


class FakeGrammar:
    """A SequenceGrammar stand-in: ready when told; terminates after ``length`` tokens."""

    def __init__(self, length: int = 3, error: str | None = None) -> None:
        self.is_ready = False
        self.error = error
        self.matcher = FakeMatcher(self)
        self.vocab_size = 64
        self.accepted: list[int] = []
        self.length = length

    def ready(self, output_token_ids: list[int]) -> bool:
        return self.is_ready

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


@pytest.fixture
def fake_fill():
    """Which rows got a mask at each step, and the tokens their grammars had accepted when
    the masks were picked."""
    return []


def _masks(scheduler, out, request_ids, filled):
    masks = scheduler.grammar_masks(out, request_ids)
    if masks is not None:
        filled.append([(row, len(m.accepted)) for m, row in zip(masks.matchers, masks.rows)])
    return masks


def _step(scheduler, runner, out, filled):
    """Pick the step's masks as the engine does (after the step before is collected), then
    run it."""
    _masks(scheduler, out, list(out.num_scheduled_tokens), filled)
    return scheduler.update_from_output(out, runner.execute(out))


class FakeMatcher:
    def __init__(self, grammar: FakeGrammar) -> None:
        self.grammar = grammar

    @property
    def accepted(self) -> list[int]:
        return self.grammar.accepted


def test_waits_for_its_compile_then_runs_and_stops_when_the_grammar_completes(fake_fill):
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(length=3)
    request = make_request("g", 5, max_tokens=10, grammar=grammar)
    scheduler.add_request(request)
    plain = make_request("p", 5, max_tokens=2, start=40)
    scheduler.add_request(plain)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["p"] and not out.grammar_request_ids
    assert scheduler.num_waiting == 1 and scheduler.has_runnable()
    _step(scheduler, runner, out, fake_fill)
    assert fake_fill == []  # no constrained row sampled: nothing filled
    grammar.is_ready = True
    outputs = []
    while scheduler.has_unfinished():
        outputs += _step(scheduler, runner, scheduler.schedule(), fake_fill)
    final = [o for o in outputs if o.request_id == "g" and o.finish_reason][0]
    assert final.finish_reason == "stop" and len(grammar.accepted) == 3
    assert request.num_output_tokens == 3  # ended by the grammar, not max_tokens
    # One mask per sampled token, each after the tokens before it were accepted.
    assert [[n for _, n in rows] for rows in fake_fill] == [[0], [1], [2]]
    assert scheduler.num_constrained == 0 and scheduler.kv.num_free_blocks == 64


def test_failed_compile_is_an_error_output_and_abort_finds_compiling_requests():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("bad", 5, grammar=FakeGrammar(error="invalid regex")))
    scheduler.add_request(make_request("slow", 5, grammar=FakeGrammar()))
    scheduler.compiling["bad"].grammar.is_ready = True
    out = scheduler.schedule()
    assert out.is_empty
    [failed] = scheduler.update_from_output(out, FakeRunner().execute(out))
    assert failed.request_id == "bad" and failed.finish_reason == "error"
    assert failed.error == "invalid regex"
    scheduler.abort_requests(["slow"])
    out = scheduler.schedule()
    [aborted] = scheduler.update_from_output(out, FakeRunner().execute(out))
    assert aborted.finish_reason == "abort" and not scheduler.has_unfinished()
    assert scheduler.num_constrained == 0 and scheduler.kv.num_free_blocks == 64


def test_a_pending_token_does_not_hold_back_a_constrained_request(fake_fill):
    """Async scheduling: the next step is scheduled while the first is in flight; its mask
    is filled only once the first step's token advanced the grammar, in the step's
    sampling order, with unconstrained rows all ones."""
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(length=99)
    grammar.is_ready = True
    scheduler.add_request(make_request("p", 4, max_tokens=8, start=40))
    scheduler.add_request(make_request("g", 4, max_tokens=8, grammar=grammar))
    first = scheduler.schedule()  # both prefill and sample: one pending token each
    assert set(first.num_scheduled_tokens) == {"g", "p"} and first.grammar_request_ids == {"g"}
    second = scheduler.schedule()  # the first is still in flight
    assert set(second.num_scheduled_tokens) == {"g", "p"}
    assert second.grammar_request_ids == {"g"}
    _step(scheduler, runner, first, fake_fill)
    assert fake_fill == [[(1, 0)]]
    masks = _masks(scheduler, second, ["p", "g"], fake_fill)
    assert fake_fill[-1] == [(1, 1)]  # after the first step's token
    assert masks.rows == [1] and masks.num_rows == 2  # row 0 (unconstrained) all ones
    scheduler.update_from_output(second, runner.execute(second))
    assert grammar.accepted and len(grammar.accepted) == 2
    assert RequestStatus.RUNNING == scheduler.requests["g"].status


def test_a_request_the_step_before_ended_gets_no_mask(fake_fill):
    """A constrained request whose grammar completes with the step in flight was scheduled
    again; its (dropped) sample needs no mask, so no xgrammar fill runs for it."""
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(length=1)
    grammar.is_ready = True
    scheduler.add_request(make_request("g", 4, max_tokens=8, grammar=grammar))
    first = scheduler.schedule()
    second = scheduler.schedule()
    _step(scheduler, runner, first, fake_fill)
    assert scheduler.requests.get("g") is None  # stopped by its grammar
    assert _masks(scheduler, second, ["g"], fake_fill) is None
    assert len(fake_fill) == 1
    outputs = scheduler.update_from_output(second, runner.execute(second))
    assert outputs == [] and len(grammar.accepted) == 1  # its second token is dropped
