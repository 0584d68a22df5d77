"""The API process's side of the engine's output socket under load: decoding a batch of
outputs is cheap (the message classes' type hints are worked out once, not per value), and
the reader hands the loop back after each message, so streams are written while a backlog
of steps is dispatched (an H100 decode worker's loop was held 1.2-2.3 s at a time by both).
"""

from __future__ import annotations

import asyncio
import typing

import pytest

from engine_core import codec
from engine_core.engine_client import AsyncEngineClient
from engine_core.messages import ENGINE_OUTPUT_CODEC, EngineOutput, EngineOutputs


def _batch(n: int, request_id: str = "r#0") -> bytes:
    return ENGINE_OUTPUT_CODEC.encode(EngineOutputs(outputs=[
        EngineOutput(request_id=request_id if i == 0 else f"other-{i}#0", new_token_ids=[7, i],
                     num_prompt_tokens=2048, num_cached_tokens=0) for i in range(n)]))


def test_type_hints_are_worked_out_once_per_class(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[type] = []
    real = typing.get_type_hints

    def counting(obj: typing.Any, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(codec.typing, "get_type_hints", counting)
    payload = _batch(75)
    for _ in range(20):
        decoded = ENGINE_OUTPUT_CODEC.decode(payload)
    assert len(decoded.outputs) == 75 and decoded.outputs[3].new_token_ids == [7, 3]
    assert len(calls) == len(set(calls))  # at most once per class over 1,500 outputs


def test_bad_token_ids_still_name_the_item() -> None:
    payload = ENGINE_OUTPUT_CODEC.encode(EngineOutputs(outputs=[EngineOutput(
        request_id="r", new_token_ids=[1, True, 3], num_prompt_tokens=1, num_cached_tokens=0)]))
    with pytest.raises(codec.MessageDecodeError, match=r"outputs\[0\]\.new_token_ids\[1\]"):
        ENGINE_OUTPUT_CODEC.decode(payload)


class _ReadySocket:
    """Every message is already there: ``recv`` returns without suspending, as zmq's does."""

    def __init__(self, payloads: list[bytes]) -> None:
        self._payloads = payloads

    async def recv(self) -> bytes:
        if not self._payloads:
            await asyncio.Event().wait()
        return self._payloads.pop(0)


def test_the_reader_yields_between_messages() -> None:
    async def run() -> list[int]:
        client = AsyncEngineClient.__new__(AsyncEngineClient)
        queue: asyncio.Queue = asyncio.Queue()
        client._output = _ReadySocket([_batch(3) for _ in range(6)])
        client._queues = {"r#0": queue}
        client._calls = {}
        client.latest_stats = None
        client.num_rejected_messages = 0
        seen: list[int] = []

        async def watch() -> None:
            while queue.qsize() < 6:
                seen.append(queue.qsize())
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        reader = asyncio.create_task(client._read_outputs())
        await asyncio.wait_for(watcher, 5.0)
        reader.cancel()
        return seen

    seen = asyncio.run(run())
    assert any(0 < size < 6 for size in seen), seen  # streams ran between the messages
