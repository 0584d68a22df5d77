"""KV that P computed for a decode leg that will never pull it is released at once.

D refused the request (a 4xx: its engine never took it, so neither its pull nor its own
release will come) after P computed the prompt, whichever of the two answered first; or a
handoff's client left before any D took the request. The proxy then asks the decode worker
to have its KV connector tell P (``/internal/kv/release``). Nothing is released for a
transfer P never held (P refused it too) or one a D took (D's own abort frees it): such a
release would wait in P as a pull of its own until it expires.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy import keys

MODEL = "tiny"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
STREAM = {**PROMPT, "stream": True}


def _release(p, transfer_ids: list[str], request_id: str = "id1") -> dict:
    return {"transfer_ids": transfer_ids, "remote_kv_address": p.zmq_address,
            "request_id": request_id}


async def _background_done(client, wait_until) -> None:
    dispatcher = client.server.app[keys.DISPATCHER]
    await wait_until(lambda: not dispatcher._background, timeout_s=5.0)


async def test_d_refusal_after_p_answered_releases_its_kv(make_worker, make_proxy,
                                                          wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "error400", delay_s=0.3)
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 400 and "D says bad" in (await resp.json())["error"]["message"]
    await wait_until(lambda: d.releases)
    assert d.releases == [_release(p, ["id1"])]
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_kv_releases_total{result="released"} 1.0' in metrics


async def test_d_refusal_before_p_answered_waits_for_p_then_releases(make_worker, make_proxy,
                                                                     wait_until) -> None:
    """D's 400 goes out at once; P's leg is not cut (cut after P's save, its KV stayed held
    for the lease) but awaited, and its KV released once P says it computed it; every
    prompt of a batch moves its own transfer."""
    p, d = await make_worker("P", delay_s=1.0), await make_worker("D", "error400")
    client = await make_proxy(p, d)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.post("/v1/completions", json={**PROMPT, "prompt": ["a", "b"]})
    assert resp.status == 400
    assert loop.time() - started < 0.8  # not held behind P
    assert d.releases == []  # P still computes
    await wait_until(lambda: d.releases, timeout_s=3.0)
    assert d.releases == [_release(p, ["id1-p0", "id1-p1"])]
    assert p.cancelled == []
    instances = await (await client.get("/instances")).json()
    assert all(w["in_flight"] == 0 for w in instances["workers"])


async def test_nothing_is_released_for_kv_p_never_held(make_worker, make_proxy,
                                                       wait_until) -> None:
    """P refused (so did D, or D accepted): there is nothing to release. D's refusal with
    P failing (5xx) neither: P computed nothing it keeps."""
    for p_mode, d_mode in (("error400", "error400"), ("error400", "ok"), ("error500", "error400")):
        p, d = await make_worker("P", p_mode), await make_worker("D", d_mode, delay_s=0.1)
        client = await make_proxy(p, d, max_attempts=1)
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status in (400, 502), (p_mode, d_mode)
        await _background_done(client, wait_until)
        assert d.releases == [], (p_mode, d_mode)


async def test_an_accepted_request_releases_nothing(make_worker, make_proxy,
                                                    wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    for body in (PROMPT, STREAM):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        await resp.read()
    await _background_done(client, wait_until)
    assert d.releases == []


async def test_handoff_d_refusal_after_the_first_token_releases(make_worker, make_proxy,
                                                                wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "error400")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    assert "D says bad" in await resp.text()
    await wait_until(lambda: d.releases)
    assert d.releases == [_release(p, ["id1"])]


@pytest.mark.parametrize("mode,released", [("error400", True), ("ok", False)])
async def test_handoff_client_gone_before_d_answered(make_worker, make_proxy, wait_until,
                                                     mode: str, released: bool) -> None:
    """The client takes P's token and leaves while D's leg is on its way: D's answer,
    awaited in the background, says who frees P's KV. A refusal took nothing: released
    through D. A stream means D's engine took the request: the leg is closed (D aborts
    it, and its connector frees or releases the KV), with no release besides."""
    p, d = await make_worker("P"), await make_worker("D", mode, delay_s=0.4)
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert json.loads(first[len(b"data: "):])["choices"][0]["text"] == "P0"
    await wait_until(lambda: len(d.received) == 1)  # D's leg went out
    resp.close()
    registry = client.server.app[keys.REGISTRY]
    await wait_until(lambda: all(w.in_flight == 0 for w in registry.workers()),
                     timeout_s=3.0)  # D's leg settled: it answered and was closed
    await _background_done(client, wait_until)
    assert d.releases == ([_release(p, ["id1"])] if released else [])


async def test_a_failed_release_is_counted_and_left_to_the_lease(make_worker, make_proxy,
                                                                 wait_until) -> None:
    p = await make_worker("P")
    d = await make_worker("D", "error400", delay_s=0.2, release_status=503)
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 400
    await wait_until(lambda: d.releases)
    await _background_done(client, wait_until)
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_kv_releases_total{result="failed"} 1.0' in metrics


async def test_background_settles_count_against_max_inflight(make_worker, make_proxy,
                                                             wait_until) -> None:
    """A P leg left running after D's quick 4xx holds a --max-inflight slot until it ends;
    with every slot taken the leg is cut instead (its KV left to the lease, counted as
    skipped), so refusals faster than P computes cannot pile up prefills past the limit."""
    p, d = await make_worker("P", delay_s=1.0), await make_worker("D", "error400")
    client = await make_proxy(p, d, max_inflight=2)
    dispatcher = client.server.app[keys.DISPATCHER]
    statuses = []
    for _ in range(4):
        resp = await client.post("/v1/completions", json=PROMPT)
        statuses.append(resp.status)
        await resp.read()
        assert len(dispatcher._background) <= 1  # + this request's own slot = the limit
    assert statuses == [400] * 4
    assert len(dispatcher._background) == 1  # the first P leg; the later ones were cut
    assert client.server.app[keys.LIMITER].count == 1
    assert len(p.cancelled) == 3
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_kv_releases_total{result="skipped"} 3.0' in metrics
    await _background_done(client, wait_until)
    await wait_until(lambda: d.releases, timeout_s=3.0)
    assert client.server.app[keys.LIMITER].count == 0
