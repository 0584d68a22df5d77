"""The grammar engine's import: once, off the event loop, after a delay or on first need."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest

from engine_core.grammar.prefetch import GrammarEngineImport
from engine_core.server.structured_fields import needs_grammar_engine


class SlowImporter:
    """Counts its calls and blocks each until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        assert self.release.wait(10)


async def test_a_request_awaits_the_import_without_blocking_the_loop() -> None:
    importer = SlowImporter()
    grammar = GrammarEngineImport(importer=importer)
    waiter = asyncio.ensure_future(grammar.ready())
    ticks = 0
    for _ in range(5):  # the loop keeps running while the import does
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and not waiter.done() and grammar.started
    importer.release.set()
    await asyncio.wait_for(waiter, 5)
    await grammar.ready()  # once done, at once, with no second import
    assert importer.calls == 1


async def test_the_delayed_start_begins_the_import_once() -> None:
    importer = SlowImporter()
    importer.release.set()
    grammar = GrammarEngineImport(importer=importer)
    grammar.start_after(0.05)
    assert not grammar.started
    await asyncio.sleep(0.3)
    assert grammar.started
    await asyncio.wait_for(grammar.ready(), 5)
    assert importer.calls == 1


async def test_an_infinite_delay_imports_only_for_a_request() -> None:
    importer = SlowImporter()
    importer.release.set()
    grammar = GrammarEngineImport(importer=importer)
    assert grammar.start_after(math.inf) is None
    await asyncio.sleep(0.1)
    assert not grammar.started and importer.calls == 0
    await asyncio.wait_for(grammar.ready(), 5)
    assert importer.calls == 1


async def test_a_request_before_the_delay_starts_it_at_once() -> None:
    importer = SlowImporter()
    importer.release.set()
    grammar = GrammarEngineImport(importer=importer)
    timer = grammar.start_after(3600)
    await asyncio.wait_for(grammar.ready(), 5)
    timer.cancel()
    assert importer.calls == 1


async def test_a_failed_import_is_logged_and_does_not_hang_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    def failing() -> None:
        raise ImportError("no xgrammar here")

    grammar = GrammarEngineImport(importer=failing)
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(grammar.ready(), 5)
    assert "importing the grammar engine failed" in caplog.text


@pytest.mark.parametrize(("body", "needs"), [
    ({"prompt": "x"}, False),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, True),
    ({"prompt": "x", "guided_regex": "a+"}, True),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"]}}, True),
    ({"messages": [], "tool_choice": "auto"}, False),
    ({"messages": [], "tool_choice": "none"}, False),
    ({"messages": [], "tool_choice": "required"}, True),
    ({"messages": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    ({"prompt": "x", "guided_json": None}, False),
])
def test_which_bodies_need_the_grammar_engine(body: dict, needs: bool) -> None:
    assert needs_grammar_engine(body) is needs
