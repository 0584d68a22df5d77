"""KV that P computed for a decode leg that will never pull it is released at once.

D refused the request (a 4xx: its engine never took it, so neither its pull nor its own
release will come) after P computed the prompt, whichever of the two answered first; or a
handoff's client left before any D took the request; or D failed (asleep, a 5xx, no answer)
after P computed the prompt, so the request moves on without that KV. The proxy tells P's KV
control socket itself (``proxy/kv_release.py``; the fake P checks the envelope and the
grant as a real one does). Nothing is released for a transfer P never held (P refused it
too) or one a D took (D's own abort frees it): such a release would wait in P as a pull of
its own until it expires.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy import keys

MODEL = "tiny"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
STREAM = {**PROMPT, "stream": True}


def _released(p, d, transfer_ids: list[str]) -> list[dict]:
    """What P's control socket got: a release of each transfer on behalf of D."""
    return [{"transfer_id": t, "producer": p.zmq_address, "consumer": d.zmq_address}
            for t in transfer_ids]


async def _settled(client, wait_until, *producers) -> None:
    """The proxy's background work done, and every release it sent received by the fake
    P's control sockets (which record on their own thread): a check of what P got, or did
    not get, comes after this."""
    dispatcher = client.server.app[keys.DISPATCHER]
    await wait_until(lambda: not dispatcher._background, timeout_s=10.0)
    await wait_until(lambda: sum(len(w.releases) for w in producers)
                     == dispatcher.releaser.messages_sent, timeout_s=5.0)


async def _stream_and_leave(client, wait_until, worker) -> None:
    """A streamed request whose client leaves once ``worker`` got its leg."""
    task = asyncio.create_task(client.post("/v1/completions", json=STREAM))
    await wait_until(lambda: len(worker.received) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_d_refusal_after_p_answered_releases_its_kv(make_worker, make_proxy,
                                                          wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "error400", delay_s=0.3)
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 400 and "D says bad" in (await resp.json())["error"]["message"]
    await wait_until(lambda: p.releases)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])
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
    assert p.releases == []  # P still computes
    await wait_until(lambda: p.releases, timeout_s=3.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1-p0", "id1-p1"])
    assert p.cancelled == []
    instances = await (await client.get("/instances")).json()
    assert all(w["in_flight"] == 0 for w in instances["workers"])


async def test_nothing_is_released_for_kv_p_never_held(make_worker, make_proxy,
                                                       wait_until) -> None:
    """P refused (so did D, or D accepted): there is nothing to release. D's refusal with
    P failing (5xx) neither: P computed nothing it keeps."""
    for p_mode, d_mode in (("error400", "error400"), ("error400", "ok"), ("error500", "error400")):
        # D answers first, so P's leg is settled in the background and its answer decides.
        p, d = await make_worker("P", p_mode, delay_s=0.5), await make_worker("D", d_mode)
        client = await make_proxy(p, d, max_attempts=1)
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status in (400, 502), (p_mode, d_mode)
        await _settled(client, wait_until, p)
        assert p.releases == [], (p_mode, d_mode)


async def test_an_accepted_request_releases_nothing(make_worker, make_proxy,
                                                    wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    for body in (PROMPT, STREAM):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        await resp.read()
    await _settled(client, wait_until, p)
    assert p.releases == []


async def test_handoff_d_refusal_after_the_first_token_releases(make_worker, make_proxy,
                                                                wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "error400")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    assert "D says bad" in await resp.text()
    await wait_until(lambda: p.releases)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])


@pytest.mark.parametrize("mode,released", [("error400", True), ("asleep", True),
                                           ("error500", True), ("ok", False)])
async def test_handoff_client_gone_before_d_answered(make_worker, make_proxy, wait_until,
                                                     mode: str, released: bool) -> None:
    """The client takes P's token and leaves while D's leg is on its way: D's answer,
    awaited in the background, says who frees P's KV. Any answer but a stream (a refusal, a
    503, a 5xx) leaves it to no one: the proxy tells P. A stream means D's engine took the request: the leg is closed (D aborts
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
    await _settled(client, wait_until, p)
    assert p.releases == (_released(p, d, ["id1"]) if released else [])


async def test_a_failed_release_is_counted_and_left_to_the_lease(make_worker, make_proxy,
                                                                 wait_until) -> None:
    """P's control socket is not reachable: the release fails within the connect timeout,
    counted, and the lease is left to free the KV."""
    p = await make_worker("P", listens_kv=False)
    d = await make_worker("D", "error400", delay_s=0.2)
    client = await make_proxy(p, d, connect_timeout_s=0.3)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 400
    metrics = client.server.app[keys.METRICS]
    await wait_until(lambda: metrics.kv_releases.labels("failed")._value.get() == 1.0,
                     timeout_s=5.0)
    await _settled(client, wait_until, p)
    text = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_kv_releases_total{result="released"}' not in text


@pytest.mark.parametrize("mode", ["asleep", "error500", "hang"])
async def test_d_failing_after_p_answered_releases_its_kv(make_worker, make_proxy, wait_until,
                                                          mode: str) -> None:
    """D answered 503 (asleep), a 5xx, or nothing before its deadline, after P computed the
    prompt: the request moves on (here to the only other worker, colocated, which computes
    the prompt itself), so nobody pulls P's KV and P is told at once."""
    p, d = await make_worker("P"), await make_worker("D", mode, delay_s=0.3)
    whole = await make_worker("colocated")
    client = await make_proxy(p, d, whole, first_byte_timeout_s=1.0)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    await resp.read()
    assert any(call["path"] == "/v1/completions" for call in whole.received)
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])


@pytest.mark.parametrize("mode", ["asleep", "error500", "down"])
async def test_d_failing_before_p_answered_waits_for_p_then_releases(
        make_worker, make_proxy, wait_until, mode: str) -> None:
    """D failed (503, 5xx, or its port closed) while P still computed: the request moves on
    at once, and P's leg is awaited in the background, not cut (cut after P's save, its KV
    stayed held for the lease), then its KV released."""
    p = await make_worker("P", delay_s=0.5)
    d = await make_worker("D", "ok" if mode == "down" else mode)
    whole = await make_worker("colocated")
    client = await make_proxy(p, d, whole)
    if mode == "down":
        assert d.server is not None
        await d.server.close()
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200 and (await resp.json())["served_by"] == "colocated"
    await wait_until(lambda: p.releases, timeout_s=3.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])
    assert p.cancelled == []


async def test_d_5xx_whose_body_breaks_still_releases(make_worker, make_proxy,
                                                      wait_until) -> None:
    """D's 500 is cut off mid-body after P answered: P is told before the body is read."""
    p, d = await make_worker("P"), await make_worker("D", "broken500", delay_s=0.2)
    client = await make_proxy(p, d, max_attempts=1)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status >= 500
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])


@pytest.mark.parametrize("handoff", [True, False])
async def test_client_leaving_while_p_computes_releases(make_worker, make_proxy, wait_until,
                                                        handoff: bool) -> None:
    """The client leaves while P computes: P's leg is cut (an abort landing after its save
    would leave the KV held) and P is told."""
    p, d = await make_worker("P", delay_s=1.0), await make_worker("D", delay_s=1.0)
    client = await make_proxy(p, d, first_token_from_prefill=handoff)
    await _stream_and_leave(client, wait_until, p)
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])
    await wait_until(lambda: p.cancelled == ["id1"])


async def test_handoff_settle_gives_up_on_a_silent_d(make_worker, make_proxy,
                                                     wait_until) -> None:
    """The client took P's token and left; D never answers: the settle waits for the
    first-byte deadline, not the decode timeout, then cuts D's leg and tells P."""
    p, d = await make_worker("P"), await make_worker("D", "hang")
    client = await make_proxy(p, d, first_token_from_prefill=True, first_byte_timeout_s=0.5)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    await wait_until(lambda: len(d.received) == 1)
    resp.close()
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])
    assert d.cancelled == ["id1"]


async def test_handoff_d_failing_releases_unless_another_d_pulls(make_worker, make_proxy,
                                                                 wait_until) -> None:
    """After P's token went out, a D that is asleep is replaced by another decode worker,
    which pulls P's KV: nothing is released. When the replacement fails with a 5xx too, the
    stream continues where the prompt is computed again, and P is told."""
    p = await make_worker("P")
    first, second = await make_worker("D", "asleep"), await make_worker("D", "error500")
    client = await make_proxy(p, first, second, first_token_from_prefill=True,
                              routing="round_robin")
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    await resp.read()
    decoded = [w for w in (first, second) if w.received]
    assert len(decoded) == 2  # the asleep one, then its replacement
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    # One release, under the grant P saved the KV for (naming the first D).
    assert p.releases == _released(p, first, ["id1"])


async def test_handoff_released_once_when_the_fallback_fails_too(
        make_worker, make_proxy, wait_until, caplog: pytest.LogCaptureFixture) -> None:
    """The only D is asleep: a colocated worker takes over (P's KV released then), and it
    fails as well: P is told once, and nothing else is attempted for that KV."""
    p, d = await make_worker("P"), await make_worker("D", "asleep")
    whole = await make_worker("colocated", "error500")
    client = await make_proxy(p, d, whole, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    await resp.read()
    assert whole.received
    # It computes the prompt itself: its leg names no KV to pull, only P's token.
    params = whole.received[0]["body"]["kv_transfer_params"]
    assert "do_remote_prefill" not in params and "grant" not in params, params
    assert params["generated_token_ids"] == [[42]]
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])
    assert "background work failed" not in caplog.text


async def test_handoff_without_ps_token_client_leaving_releases(make_worker, make_proxy,
                                                                wait_until) -> None:
    """A P that answered no first token: D computes it. The client leaves while D's leg
    waits: the leg is cut, and P's KV released (no decode leg goes on to pull it)."""
    p = await make_worker("P", "no_first_token")
    d = await make_worker("D", "hang")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    await _stream_and_leave(client, wait_until, d)
    await wait_until(lambda: p.releases, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert p.releases == _released(p, d, ["id1"])


async def test_handoff_replacement_d_has_the_first_ones_layout(make_worker, make_proxy,
                                                               wait_until) -> None:
    """P saved its KV in the routes of the first D's layout: a replacement decode worker of
    another layout could not pull them, so it is passed over for a worker that computes the
    prompt itself, and P's routes are released as saved (each rank to the first D's)."""
    p = await make_worker("P", kv_tp=2)
    first = await make_worker("D", "asleep", kv_tp=2)
    other_layout = await make_worker("D", kv_tp=1)
    whole = await make_worker("colocated")
    client = await make_proxy(p, first, other_layout, whole, first_token_from_prefill=True,
                              routing="round_robin")
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    await resp.read()
    assert first.received and whole.received and not other_layout.received
    await wait_until(lambda: len(p.releases) == 2, timeout_s=5.0)
    await _settled(client, wait_until, p)
    assert sorted(r["transfer_id"] for r in p.releases) == ["id1/kv0-0", "id1/kv1-1"]
    assert {r["consumer"] for r in p.releases} == {f"127.0.0.1:{first.kv_port + r}"
                                                   for r in range(2)}


async def test_a_release_reaches_every_rank_of_each_route(make_worker, make_proxy,
                                                          wait_until) -> None:
    """Between tensor-parallel layouts each route is its own transfer: every P rank that
    holds one is told, under that route's id and a grant naming that rank."""
    p = await make_worker("P", kv_tp=2)
    d = await make_worker("D", "error400", delay_s=0.3, kv_tp=2)
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=PROMPT)).status == 400
    await wait_until(lambda: len(p.releases) == 2)
    await _settled(client, wait_until, p)
    ranks = [f"127.0.0.1:{p.kv_port + r}" for r in range(2)]
    consumers = [f"127.0.0.1:{d.kv_port + r}" for r in range(2)]
    assert sorted(p.releases, key=lambda r: r["transfer_id"]) == [
        {"transfer_id": f"id1/kv{r}-{r}", "producer": ranks[r], "consumer": consumers[r]}
        for r in range(2)]


async def test_background_settles_count_against_max_inflight(make_worker, make_proxy,
                                                             wait_until) -> None:
    """A P leg left running after D's quick 4xx holds a --max-inflight slot until it ends;
    with every slot taken the leg is cut instead and P told at once (a release holds no
    slot), so refusals faster than P computes cannot pile up prefills past the limit."""
    p, d = await make_worker("P", delay_s=1.0), await make_worker("D", "error400")
    client = await make_proxy(p, d, max_inflight=2)
    limiter = client.server.app[keys.LIMITER]
    statuses = []
    for _ in range(4):
        resp = await client.post("/v1/completions", json=PROMPT)
        statuses.append(resp.status)
        await resp.read()
        assert limiter.count <= 1  # the one settle's slot; this request's own went back
    assert statuses == [400] * 4
    assert limiter.count == 1  # the first P leg; the later ones were cut
    assert len(p.cancelled) == 3
    await _settled(client, wait_until, p)
    assert sorted(r["transfer_id"] for r in p.releases) == ["id1", "id2", "id3", "id4"]
    assert limiter.count == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_kv_releases_total{result="released"} 4.0' in metrics
    assert 'result="skipped"' not in metrics
