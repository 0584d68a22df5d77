"""Request migration with fake workers: a decode leg that dies, stalls, errs, never answers
or whose worker leaves is continued on another worker after the tokens the client holds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy import keys
from proxy.migration import SSEEvents, continuable

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
STREAM = {**PROMPT, "stream": True}


def texts(body: str) -> list[str]:
    """The text of each data event, and [DONE]."""
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" or "error" in json.loads(e) else
            json.loads(e)["choices"][0]["text"] for e in events]


def migrations(metrics: str) -> dict[str, float]:
    found = {}
    for line in metrics.splitlines():
        if line.startswith("pdserve:proxy_migrations_total{"):
            label, value = line.split("} ")
            found[label.split('"')[1]] = float(value)
    return found


def test_events_are_whole_and_their_token_ids_stripped() -> None:
    events = SSEEvents()
    first = events.feed(b': pdserve_token_ids=5,6\ndata: {"a":1}\n\n: pdserve_token_ids=7\nda')
    assert (first.data, first.token_ids, first.end) == (b'data: {"a":1}\n\n', [5, 6], None)
    rest = events.feed(b'ta: {"b":2}\n\ndata: [DONE]\n\nignored')
    assert (rest.data, rest.token_ids, rest.end) == (
        b'data: {"b":2}\n\ndata: [DONE]\n\n', [7], "done")
    failed = SSEEvents().feed(b'data: {"c":3}\n\ndata: {"error": {"code": 503}}\n\ndata: [DONE]\n\n')
    assert (failed.data, failed.end) == (b'data: {"c":3}\n\n', "error")
    assert failed.error_event.startswith(b'data: {"error"')


def test_what_can_continue() -> None:
    assert continuable("/v1/completions", STREAM)
    assert continuable("/v1/completions", {**STREAM, "prompt": [1, 2]})
    assert continuable("/v1/chat/completions", {"messages": []})
    for extra in ({"stop": ["x"]}, {"logprobs": 0}, {"n": 2}, {"echo": True},
                  {"prompt": ["a", "b"]}):
        assert not continuable("/v1/completions", {**STREAM, **extra}), extra


async def test_a_stream_cut_mid_way_continues_on_another_worker(make_worker, make_proxy) -> None:
    p, dead, live = (await make_worker("P"), await make_worker("D", "fail_mid"),
                     await make_worker("D"))
    client = await make_proxy(p, dead, live)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    assert texts(await resp.text()) == ["t0", "t1", "t2", "[DONE]"]  # none lost or repeated
    (continued,) = live.received
    assert continued["request_id"] == dead.received[0]["request_id"]  # the client's stream id
    assert continued["body"]["kv_transfer_params"] == {
        "generated_token_ids": [[100, 101]], "stream_token_ids": True}
    assert continued["body"]["max_tokens"] == 8  # the tokens handed over count within it
    assert migrations(await (await client.get("/metrics")).text()) == {"disconnect": 1.0}


async def test_error_event_and_stall_migrate(make_worker, make_proxy) -> None:
    for mode, reason in (("error_mid", "error_event"), ("stall_mid", "timeout")):
        p, failing, live = (await make_worker("P"), await make_worker("D", mode),
                            await make_worker("D"))
        client = await make_proxy(p, failing, live, stall_timeout_s=0.3)
        resp = await client.post("/v1/completions", json=STREAM)
        assert texts(await resp.text()) == ["t0", "t1", "t2", "[DONE]"], mode
        (continued,) = live.received
        assert continued["body"]["kv_transfer_params"]["generated_token_ids"] == [[100, 101]]
        assert migrations(await (await client.get("/metrics")).text()) == {reason: 1.0}


async def test_a_worker_that_never_answers_is_left_at_the_first_byte_deadline(
        make_worker, make_proxy) -> None:
    p, silent, live = (await make_worker("P"), await make_worker("D", "hang"),
                       await make_worker("D"))
    client = await make_proxy(p, silent, live, first_byte_timeout_s=0.3)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200 and texts(await resp.text()) == ["t0", "t1", "t2", "[DONE]"]
    assert len(silent.received) == 1 and len(live.received) == 1
    assert silent.cancelled  # its leg was closed, which aborts it there
    assert migrations(await (await client.get("/metrics")).text()) == {"timeout": 1.0}


def _expire(registry: Any, http_address: str) -> None:
    """The worker's heartbeats stopped long ago: the registry's sweep drops it."""
    registry.get(http_address).last_heartbeat = float("-inf")
    assert registry.expire() == [http_address]


async def test_a_worker_whose_heartbeats_stopped_loses_its_legs(make_worker, make_proxy,
                                                                wait_until) -> None:
    """Heartbeats stopped: its open leg is cut at once, whether it is still computing a
    whole answer or mid-stream."""
    first, second = await make_worker("colocated", "hang"), await make_worker("colocated")
    client = await make_proxy(first, second)
    registry = client.app[keys.REGISTRY]
    whole = asyncio.create_task(client.post("/v1/completions", json=PROMPT))
    await wait_until(lambda: len(first.received) == 1)
    _expire(registry, first.http_address)
    resp = await whole
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "xxx"
    assert migrations(await (await client.get("/metrics")).text()) == {"lost": 1.0}

    stalling, live = await make_worker("colocated", "stall_mid"), await make_worker("colocated")
    client = await make_proxy(stalling, live)
    stream = asyncio.create_task(client.post("/v1/completions", json=STREAM))
    await wait_until(lambda: len(stalling.received) == 1)
    await asyncio.sleep(0.2)  # its two events reached the client
    _expire(client.app[keys.REGISTRY], stalling.http_address)
    resp = await stream
    assert texts(await resp.text()) == ["t0", "t1", "t2", "[DONE]"]
    assert live.received[0]["body"]["kv_transfer_params"]["generated_token_ids"] == [[100, 101]]
    assert migrations(await (await client.get("/metrics")).text()) == {"lost": 1.0}


async def test_a_deregistered_worker_finishes_its_legs(make_worker, make_proxy,
                                                       wait_until) -> None:
    """A clean deregistration is a drain: the worker's open stream ends there, unmoved."""
    draining, other = await make_worker("colocated", "slow"), await make_worker("colocated")
    client = await make_proxy(draining, other)
    stream = asyncio.create_task(client.post("/v1/completions", json=STREAM))
    await wait_until(lambda: len(draining.received) == 1)
    client.app[keys.REGISTRY].remove(draining.http_address)
    resp = await stream
    assert texts(await resp.text()) == [f"t{i}" for i in range(100)] + ["[DONE]"]
    assert other.received == []
    assert migrations(await (await client.get("/metrics")).text()) == {}


async def test_non_streamed_request_moves_when_its_worker_fails(make_worker, make_proxy) -> None:
    p, bad, good = await make_worker("P"), await make_worker("D", "error500"), \
        await make_worker("D")
    client = await make_proxy(p, bad, good)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200 and (await resp.json())["served_by"] == "D"
    assert len(bad.received) == 1 and len(good.received) == 1
    assert migrations(await (await client.get("/metrics")).text()) == {"status": 1.0}


async def test_migration_limit_bounds_the_moves(make_worker, make_proxy) -> None:
    p = await make_worker("P")
    ds = [await make_worker("D", "fail_mid"), await make_worker("D", "hang"),
          await make_worker("D", "hang")]
    client = await make_proxy(p, *ds, migration_limit=1, first_byte_timeout_s=0.3)
    resp = await client.post("/v1/completions", json=STREAM)
    body = await resp.text()
    assert resp.status == 200 and '"error"' in body and body.endswith("data: [DONE]\n\n")
    assert texts(body)[:2] == ["t0", "t1"]
    assert sum(len(d.received) for d in ds) == 2  # the first and one continuation
    assert migrations(await (await client.get("/metrics")).text()) == {
        "disconnect": 1.0, "limit": 1.0}


async def test_a_stream_that_cannot_continue_ends_with_an_error_event(make_worker,
                                                                      make_proxy) -> None:
    p, dead, live = (await make_worker("P"), await make_worker("D", "fail_mid"),
                     await make_worker("D"))
    client = await make_proxy(p, dead, live)
    resp = await client.post("/v1/completions", json={**STREAM, "stop": ["zz"]})
    body = await resp.text()
    assert texts(body)[:2] == ["t0", "t1"] and '"error"' in body
    assert not live.received


async def test_a_handoff_stream_continues_after_p_token_and_ds(make_worker, make_proxy) -> None:
    """First-token handoff: the client holds P's token (42) and D's; the continuation
    carries both, and the client sees every text once."""
    p, dead, live = (await make_worker("P"), await make_worker("D", "fail_mid"),
                     await make_worker("D"))
    client = await make_proxy(p, dead, live, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert texts(await resp.text()) == ["P0", "t0", "t1", "t2", "[DONE]"]
    (continued,) = live.received
    assert continued["body"]["kv_transfer_params"]["generated_token_ids"] == [[42, 100, 101]]


async def test_a_handoff_decode_leg_that_never_answers_moves(make_worker, make_proxy) -> None:
    p, silent, live = (await make_worker("P"), await make_worker("D", "hang"),
                       await make_worker("D"))
    client = await make_proxy(p, silent, live, first_token_from_prefill=True,
                              first_byte_timeout_s=0.3)
    resp = await client.post("/v1/completions", json=STREAM)
    assert texts(await resp.text()) == ["P0", "t0", "t1", "t2", "[DONE]"]
    assert live.received[0]["body"]["kv_transfer_params"]["generated_token_ids"] == [[42]]
    assert migrations(await (await client.get("/metrics")).text()) == {"timeout": 1.0}
