"""Scheduler rules for requests with a grammar: they wait while it compiles, a failed
compile ends them with an error (no blocks held), an abort finds them, a grammar that
completes ends them as a stop, and a pending token keeps them out of the next step."""

from __future__ import annotations

import numpy as np
import pytest

import engine_core.sched.scheduler as scheduler_module
from engine_core.grammar.bitmask import GrammarBitmask
from engine_core.request import RequestStatus
from tests.engine_core.test_scheduler import FakeRunner, make_request, make_scheduler


class FakeGrammar:
    """A SequenceGrammar stand-in: ready when told; terminates after ``length`` tokens."""

    def __init__(self, length: int = 3, error: str | None = None) -> None:
        self.is_ready = False
        self.error = error
        self.matcher = object()
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


@pytest.fixture(autouse=True)
def fake_fill(monkeypatch):
    """Masks without xgrammar: record which requests got one."""
    filled: list[list[str]] = []

    class FakeFiller:
        def fill(self, request_ids, matchers, vocab_size):
            filled.append(list(request_ids))
            return GrammarBitmask(list(request_ids),
                                  np.full((len(request_ids), 2), -1, np.int32))

    monkeypatch.setattr(scheduler_module, "BitmaskFiller", FakeFiller)
    return filled


def test_waits_for_its_compile_then_runs_and_stops_when_the_grammar_completes(fake_fill):
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(length=3)
    request = make_request("g", 5, max_tokens=10, grammar=grammar)
    scheduler.add_request(request)
    plain = make_request("p", 5, max_tokens=2, start=40)
    scheduler.add_request(plain)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["p"] and out.grammar_bitmask is None
    assert scheduler.num_waiting == 1 and scheduler.has_runnable()
    scheduler.update_from_output(out, runner.execute(out))
    grammar.is_ready = True
    outputs = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        outputs += scheduler.update_from_output(out, runner.execute(out))
    final = [o for o in outputs if o.request_id == "g" and o.finish_reason][0]
    assert final.finish_reason == "stop" and len(grammar.accepted) == 3
    assert request.num_output_tokens == 3  # ended by the grammar, not max_tokens
    assert all(ids == ["g"] for ids in fake_fill) and len(fake_fill) == 3
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


def test_a_pending_token_keeps_a_constrained_request_out_of_the_next_step():
    scheduler, runner = make_scheduler(), FakeRunner()
    grammar = FakeGrammar(length=99)
    grammar.is_ready = True
    scheduler.add_request(make_request("g", 4, max_tokens=8, grammar=grammar))
    scheduler.add_request(make_request("p", 4, max_tokens=8, start=40))
    first = scheduler.schedule()  # both prefill and sample: one pending token each
    assert set(first.num_scheduled_tokens) == {"g", "p"}
    second = scheduler.schedule()  # async scheduling: the first is still in flight
    assert list(second.num_scheduled_tokens) == ["p"] and second.grammar_bitmask is None
    scheduler.update_from_output(first, runner.execute(first))
    scheduler.update_from_output(second, runner.execute(second))
    third = scheduler.schedule()
    assert "g" in third.num_scheduled_tokens and third.grammar_bitmask is not None
    assert RequestStatus.RUNNING == scheduler.requests["g"].status
