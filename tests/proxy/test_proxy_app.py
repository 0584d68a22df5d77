"""The proxy app in front of fake P, D and colocated workers (aiohttp on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import ModelNotFoundError
from engine_core.server.streaming import WriteBound
from proxy import keys
from proxy.client_stream import open_stream
from proxy.config import ProxyConfig

MODEL = "tiny"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 8}


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


async def test_both_legs_get_transfer_params(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    body = {**PROMPT, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"transfer_id": "spoofed"}, "min_tokens": 4}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["served_by"] == "D"
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    transfer_id = resp.headers["X-Request-Id"]
    assert transfer_id == "id1"
    assert float(resp.headers["X-Pdserve-Prefill-Ms"]) >= 0
    assert float(resp.headers["X-Pdserve-Proxy-Overhead-Ms"]) >= 0
    (p_req,), (d_req,) = p.received, d.received
    assert p_req["path"] == d_req["path"] == "/v1/completions"
    # P gets the client's own request (its limits, stream_options, min_tokens: P validates
    # them as D will, then runs one token itself), marked as a prefill for D.
    grant = p_req["body"]["kv_transfer_params"]["grant"]
    assert p_req["body"] == {**body, "kv_transfer_params": {
        "transfer_id": transfer_id, "do_remote_decode": True, "remote_kv_address": d.zmq_address,
        "grant": grant}}
    assert d_req["body"] == {**body, "kv_transfer_params": {
        "transfer_id": transfer_id, "do_remote_prefill": True, "remote_kv_address": p.zmq_address,
        "grant": grant}}
    assert p_req["request_id"] == d_req["request_id"] == transfer_id


async def test_streaming_passthrough(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                   "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2"]
    assert d.received[0]["path"] == "/v1/chat/completions"
    assert d.received[0]["body"]["stream"] is True and p.received[0]["body"]["stream"] is True


async def test_x_request_id_honoured_as_base(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    ids = []
    for _ in range(2):
        resp = await client.post("/v1/completions", json=PROMPT,
                                 headers={"X-Request-Id": "client req/1"})
        assert resp.status == 200
        ids.append(resp.headers["X-Request-Id"])
    assert ids[0].startswith("client_req_1-") and ids[0] != ids[1]
    assert d.received[0]["body"]["kv_transfer_params"]["transfer_id"] == ids[0]


async def test_prefill_failure_retries_on_other_prefill(make_worker, make_proxy) -> None:
    bad, good, d = await make_worker("P", "error500"), await make_worker("P"), await make_worker("D")
    client = await make_proxy(bad, good, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200 and (await resp.json())["served_by"] == "D"
    assert len(bad.received) == 1 and len(good.received) == 1
    retry_id = good.received[0]["body"]["kv_transfer_params"]["transfer_id"]
    assert retry_id == "id1-retry1"
    params = d.received[-1]["body"]["kv_transfer_params"]
    assert params == {
        "transfer_id": retry_id, "do_remote_prefill": True, "remote_kv_address": good.zmq_address,
        "grant": params["grant"]}
    assert params["grant"] == good.received[0]["body"]["kv_transfer_params"]["grant"]
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_retries_total{reason="prefill_status"} 1.0' in metrics


async def test_prefill_unreachable_with_single_prefill_goes_decode_only(make_worker,
                                                                       make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    await p.server.close()  # registered but dead: connection refused
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200
    assert sse_events(await resp.text())[-1] == "[DONE]"
    assert len(d.received) == 2
    # decode-only: D prefills itself (a stream's events name their tokens, for migration)
    assert d.received[-1]["body"]["kv_transfer_params"] == {"stream_token_ids": True}
    assert d.received[-1]["body"]["stream"] is True


async def test_prefill_timeout_goes_decode_only_and_aborts_d(make_worker, make_proxy,
                                                              wait_until) -> None:
    p, d = await make_worker("P", "hang"), await make_worker("D")
    client = await make_proxy(p, d, prefill_timeout_s=0.5)  # P's leg reaches P in time
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200
    assert "kv_transfer_params" not in d.received[-1]["body"]
    await wait_until(lambda: p.cancelled == ["id1"])


async def test_prefill_overflow_sends_d_alone_while_p_is_full(make_worker, make_proxy,
                                                            wait_until) -> None:
    """With --prefill-overflow 1, a request arriving while P's one prefill is still running
    goes to D alone (no transfer params: D prefills it); the held one still goes P then D."""
    p, d = await make_worker("P", "hang"), await make_worker("D")
    client = await make_proxy(p, d, prefill_overflow=1, prefill_timeout_s=30.0)
    first = asyncio.create_task(client.post("/v1/completions", json=PROMPT))
    await wait_until(lambda: len(p.received) == 1)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200
    assert sse_events(await resp.text())[-1] == "[DONE]"
    assert len(p.received) == 1  # the second request never reached P
    alone = [r for r in d.received if r["request_id"] == "id2"]
    # D alone: no transfer (a stream's events name their tokens, for migration)
    assert len(alone) == 1 and alone[0]["body"]["kv_transfer_params"] == {
        "stream_token_ids": True}
    metrics = await (await client.get("/metrics")).text()
    assert 'mode="prefill_overflow"' in metrics
    first.cancel()
    await wait_until(lambda: p.cancelled == ["id1"])


async def test_decode_failure_mid_stream_ends_with_error_event(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D", "fail_mid")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    error = json.loads(events[2])["error"]
    assert error["type"] == "upstream_error" and set(error) == {"message", "type", "param", "code"}
    assert events[3:] == ["[DONE]"]


async def test_stream_without_done_is_reported(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D", "no_done")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    events = sse_events(await resp.text())
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"


async def test_decode_failure_before_bytes_is_502(make_worker, make_proxy) -> None:
    for mode in ("error500", "empty"):
        p, d = await make_worker("P"), await make_worker("D", mode)
        client = await make_proxy(p, d)
        for stream in (False, True):
            resp = await client.post("/v1/completions", json={**PROMPT, "stream": stream})
            assert resp.status == 502, mode
            error = (await resp.json())["error"]
            assert error["type"] == "upstream_error" and error["code"] == "bad_gateway"


async def test_asleep_decode_is_skipped_then_503_when_none_is_awake(make_worker,
                                                                     make_proxy) -> None:
    """A D that answers 503 (asleep before its heartbeat says so) gets the request tried on
    another D; with every D asleep the client gets a 503, not a 502."""
    p, asleep, awake = await make_worker("P"), await make_worker("D", "asleep"), \
        await make_worker("D")
    client = await make_proxy(p, asleep, awake)
    for stream in (False, True, False, True):
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": stream})
        assert resp.status == 200
        await resp.read()
    assert len(awake.received) == 4 and asleep.received  # round robin tried it too
    p2, lone = await make_worker("P"), await make_worker("D", "asleep")
    client = await make_proxy(p2, lone)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["code"] == "worker_unavailable" and "asleep" in error["message"]


async def test_decode_unreachable_is_502_after_retries(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    await d.server.close()
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 502
    assert "cannot connect" in (await resp.json())["error"]["message"]


async def test_client_disconnect_aborts_both_legs(make_worker, make_proxy, wait_until) -> None:
    p, d = await make_worker("P", "hang"), await make_worker("D", "hang")
    client = await make_proxy(p, d)
    request = asyncio.ensure_future(client.post("/v1/completions", json=PROMPT))
    await wait_until(lambda: len(p.received) == 1 and len(d.received) == 1)
    request.cancel()  # the client goes away while both legs are in flight
    await asyncio.gather(request, return_exceptions=True)
    await wait_until(lambda: p.cancelled == ["id1"] and d.cancelled == ["id1"])
    await wait_until(lambda: all(w["in_flight"] == 0 for w in _instances_now(client)))


def _instances_now(client) -> list[dict]:
    return client.server.app[keys.REGISTRY].snapshot()


async def test_client_disconnect_mid_stream_aborts_decode(make_worker, make_proxy,
                                                          wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "slow")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200
    await resp.content.readany()
    resp.close()
    await wait_until(lambda: d.cancelled == ["id1"])


async def test_no_workers_is_503(make_proxy) -> None:
    client = await make_proxy()
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "No worker" in error["message"]


async def test_over_max_inflight_is_429(make_worker, make_proxy, wait_until) -> None:
    p, d = await make_worker("P", "hang"), await make_worker("D")
    client = await make_proxy(p, d, max_inflight=1)
    first = asyncio.ensure_future(client.post("/v1/completions", json=PROMPT))
    await wait_until(lambda: len(p.received) == 1)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 429
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_oversized_body_is_413(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, max_body_bytes=1000)
    resp = await client.post("/v1/completions", json={**PROMPT, "prompt": "x" * 5000})
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    assert p.received == [] and d.received == []


async def test_invalid_json_is_400(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # deeper than the recursion limit
    for payload in (b"{not json", b"[1, 2]", deep, b'{"prompt": "a", "temperature": NaN}'):
        resp = await client.post("/v1/completions", data=payload,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    assert p.received == [] and d.received == []


async def test_worker_400_forwarded_unchanged(make_worker, make_proxy) -> None:
    for bad_role in ("P", "D"):
        p = await make_worker("P", "error400" if bad_role == "P" else "ok")
        d = await make_worker("D", "error400" if bad_role == "D" else "ok")
        client = await make_proxy(p, d)
        resp = await client.post("/v1/completions", json={**PROMPT, "n": -1})
        assert resp.status == 400
        assert (await resp.json()) == {"error": {"message": f"{bad_role} says bad",
                                                 "type": "invalid_request_error", "param": "n",
                                                 "code": None}}


async def test_unknown_model_is_404(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={**PROMPT, "model": "other"})
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_colocated_gets_whole_request(make_worker, make_proxy) -> None:
    c = await make_worker("colocated")
    client = await make_proxy(c)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200 and sse_events(await resp.text())[-1] == "[DONE]"
    assert c.received[0]["body"] == {**PROMPT, "stream": True,
                                     "kv_transfer_params": {"stream_token_ids": True}}


async def test_models_health_instances_metrics(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=PROMPT)).status == 200
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = await (await client.get("/health")).json()
    assert health == {"status": "ok", "workers": {"P": 1, "D": 1, "colocated": 0, "worker": 0}}
    instances = await (await client.get("/instances")).json()
    assert {w["role"] for w in instances["workers"]} == {"P", "D"}
    assert all(w["num_requests"] == 1 and w["in_flight"] == 0 for w in instances["workers"])
    text = await (await client.get("/metrics")).text()
    for needle in ('pdserve:proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0',
                   f'pdserve:proxy_worker_requests_total{{role="prefill",worker="{p.http_address}"}} 1.0',
                   'pdserve:proxy_routing_decisions_total{decode="',
                   'pdserve:proxy_prefill_leg_seconds_count 1.0',
                   'pdserve:proxy_time_to_first_byte_seconds_count{mode="pd"} 1.0',
                   'pdserve:proxy_overhead_seconds_count{mode="pd"} 1.0',
                   'pdserve:proxy_queue_time_seconds_count 1.0',
                   'pdserve:proxy_registered_workers{role="prefill"} 1.0',
                   f'pdserve:proxy_worker_in_flight{{role="decode",worker="{d.http_address}"}} 0.0',
                   'pdserve:proxy_in_flight_requests 0.0',
                   'pdserve:proxy_event_loop_stalls_total '):
        assert needle in text, needle


async def test_openai_client_through_proxy(make_worker, make_proxy) -> None:
    import openai

    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        completion = await api.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert completion.choices[0].text == "xxx"
        stream = await api.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)
        assert [chunk.choices[0].text async for chunk in stream] == ["t0", "t1", "t2"]
    finally:
        await api.close()


async def test_decode_timeout_is_504(make_worker, make_proxy, wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D", "hang")
    client = await make_proxy(p, d, decode_timeout_s=0.2)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "upstream_timeout"
    await wait_until(lambda: d.cancelled == ["id1"])


async def test_least_load_spreads_over_decode_workers(make_worker, make_proxy) -> None:
    p = await make_worker("P")
    d1, d2 = await make_worker("D"), await make_worker("D")
    client = await make_proxy(p, d1, d2, routing="least_load")
    results = await asyncio.gather(*[client.post("/v1/completions", json=PROMPT) for _ in range(6)])
    assert all(r.status == 200 for r in results)
    assert len(d1.received) + len(d2.received) == 6 and d1.received and d2.received


def test_prefill_body_is_the_clients_request_marked_for_remote_decode() -> None:
    """P is sent what the client sent (bar its own transfer params): the plain and the
    handoff prefill share it, and differ only in asking for the first token's events."""
    from proxy.forwarding import handoff_prefill_body, prefill_body

    chat = {"model": MODEL, "messages": [], "max_completion_tokens": 50, "n": 3,
            "min_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"transfer_id": "spoofed"}}
    transfer = {"transfer_id": "t1", "do_remote_decode": True, "remote_kv_address": "d:1",
                "grant": "g1.x.y"}
    client_fields = {k: v for k, v in chat.items() if k != "kv_transfer_params"}
    assert prefill_body(chat, "t1", "d:1", "g1.x.y") == {**client_fields,
                                                         "kv_transfer_params": transfer}
    assert handoff_prefill_body(chat, "t1", "d:1", "g1.x.y") == {
        **client_fields, "kv_transfer_params": {**transfer, "first_token_events": True}}
    assert chat["kv_transfer_params"] == {"transfer_id": "spoofed"}  # the client's untouched


async def test_both_legs_carry_one_grant_naming_their_p_and_d(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=PROMPT)).status == 200
    (p_params,), (d_params,) = ([r["body"]["kv_transfer_params"] for r in w.received]
                                for w in (p, d))
    assert p_params["grant"] == d_params["grant"]
    grant = GrantAuthority(ClusterSecret()).verify(
        p_params["grant"], transfer_id=p_params["transfer_id"], producer=p.zmq_address,
        consumer=d.zmq_address)
    assert grant.transfer_id == d_params["transfer_id"]


def test_prompt_transfer_ids_follow_the_workers_per_prompt_ids() -> None:
    from proxy.forwarding import prompt_transfer_ids

    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    assert prompt_transfer_ids(chat, {"messages": []}, "T") == ["T"]
    for prompt in ("a", [1, 2], ["a"], [[1, 2]], None, []):
        assert prompt_transfer_ids(cmpl, {"prompt": prompt}, "T") == ["T"], prompt
    assert prompt_transfer_ids(cmpl, {"prompt": ["a", [1]]}, "T") == ["T-p0", "T-p1"]


# ---- first-token handoff (default; --no-first-token-from-prefill) -----------------------

STREAM = {**PROMPT, "stream": True, "min_tokens": 3}


async def test_handoff_streams_p_token_then_d_continues(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["P0", "t0", "t1", "t2"]
    assert events[-1] == "[DONE]"
    (p_req,), (d_req,) = p.received, d.received
    # P first, alone: D's leg carries P's token, so it leaves after P answered.
    assert p_req["body"]["kv_transfer_params"]["first_token_events"] is True
    # P validates the client's own request (and samples one token itself, answering JSON).
    assert (p_req["body"]["min_tokens"], p_req["body"]["max_tokens"]) == (3, 8)
    assert p_req["body"]["stream"] is True
    assert d_req["body"]["kv_transfer_params"] == {
        "transfer_id": "id1", "do_remote_prefill": True, "remote_kv_address": p.zmq_address,
        "generated_token_ids": [[42]], "stream_token_ids": True,
        "grant": p_req["body"]["kv_transfer_params"]["grant"]}
    assert d_req["body"]["min_tokens"] == 3 and d_req["body"]["stream"] is True
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_first_token_handoffs_total{result="prefill"} 1.0' in metrics


async def test_handoff_is_the_default_and_carries_every_stream_feature(make_worker,
                                                                       make_proxy) -> None:
    """Stop strings, logprobs, n > 1 and a one-token limit take the handoff by default:
    D continues each choice after P's token for it; off, D computes the first tokens."""
    assert ProxyConfig().first_token_from_prefill
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    bodies = ({**STREAM, "stop": ["x"], "include_stop_str_in_output": True},
              {**STREAM, "logprobs": 0}, {**STREAM, "max_tokens": 1, "min_tokens": 0},
              {**STREAM, "n": 2, "seed": 5, "temperature": 0.8})
    for body in bodies:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        events = sse_events(await resp.text())
        firsts = [json.loads(e)["choices"][0]["text"] for e in events[:body.get("n", 1)]]
        assert firsts == [f"P{i}" for i in range(body.get("n", 1))], events
    assert all(r["body"]["kv_transfer_params"]["first_token_events"] for r in p.received)
    assert [r["body"]["kv_transfer_params"]["generated_token_ids"] for r in d.received] == [
        [[42]], [[42]], [[42]], [[42], [42]]]
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_first_token_handoffs_total{result="prefill"} 4.0' in metrics

    off = await make_proxy(p, d, first_token_from_prefill=False)
    resp = await off.post("/v1/completions", json=STREAM)
    assert resp.status == 200 and "P0" not in await resp.text()
    assert "first_token_events" not in p.received[-1]["body"]["kv_transfer_params"]
    assert "generated_token_ids" not in d.received[-1]["body"]["kv_transfer_params"]


async def test_handoff_falls_back_when_p_sends_no_token(make_worker, make_proxy) -> None:
    p, d = await make_worker("P", "no_first_token"), await make_worker("D")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    events = sse_events(await resp.text())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2"]
    assert "generated_token_ids" not in d.received[0]["body"]["kv_transfer_params"]
    metrics = await (await client.get("/metrics")).text()
    assert 'pdserve:proxy_first_token_handoffs_total{result="decode"} 1.0' in metrics


async def test_handoff_skipped_for_what_it_cannot_carry(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    for body in ({**STREAM, "prompt": ["a", "b"]}, PROMPT, {**STREAM, "echo": True},
                 {**STREAM, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}},
                 {**STREAM, "stream_options": {"include_usage": "yes"}}):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        await resp.read()
    assert not any("first_token_events" in r["body"]["kv_transfer_params"] for r in p.received)
    metrics = await (await client.get("/metrics")).text()
    for reason in ("prompt_batch", "not_streaming", "echo", "continuous_usage",
                   "stream_options"):
        assert f'first_token_handoffs_total{{result="{reason}"}} 1.0' in metrics, reason


async def test_handoff_refusal_counts_requests_not_attempts(make_worker, make_proxy) -> None:
    """A request P fails for is tried again: its reason is still one request's."""
    bad, good, d = await make_worker("P", "error500"), await make_worker("P"), await make_worker("D")
    client = await make_proxy(bad, good, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200 and len(bad.received) == len(good.received) == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'first_token_handoffs_total{result="not_streaming"} 1.0' in metrics


def handoff_counts(metrics: str) -> dict[str, float]:
    """The first-token handoff counter's value per result label."""
    prefix = 'pdserve:proxy_first_token_handoffs_total{result="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith(prefix)}


async def test_handoff_fallback_decode_retry_counts_the_request_once(make_worker,
                                                                     make_proxy) -> None:
    """P answers no token and the fallback D cannot be reached (or is asleep): the request
    goes round again, and only the attempt that serves it counts, under its own result."""
    for mode in ("unreachable", "asleep"):
        p = await make_worker("P", "no_first_token")
        bad, good = await make_worker("D", "ok" if mode == "unreachable" else mode), \
            await make_worker("D")
        client = await make_proxy(p, bad, good, first_token_from_prefill=True)
        if mode == "unreachable":
            await bad.server.close()
        resp = await client.post("/v1/completions", json=STREAM)  # round robin: bad D first
        events = sse_events(await resp.text())
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2"]
        assert len(p.received) == 2 and len(good.received) == 1, mode
        metrics = await (await client.get("/metrics")).text()
        assert handoff_counts(metrics) == {"decode": 1.0}, mode
    # The retry's P sends its token: the request counts as P's, not also as D's.
    no_token, p = await make_worker("P", "no_first_token"), await make_worker("P")
    bad, good = await make_worker("D"), await make_worker("D")
    client = await make_proxy(no_token, p, bad, good, first_token_from_prefill=True)
    await bad.server.close()
    resp = await client.post("/v1/completions", json=STREAM)
    events = sse_events(await resp.text())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["P0", "t0", "t1", "t2"]
    assert len(no_token.received) == len(p.received) == 1
    metrics = await (await client.get("/metrics")).text()
    assert handoff_counts(metrics) == {"prefill": 1.0}


async def test_handoff_d_refusal_after_first_token_is_an_sse_error(make_worker,
                                                                   make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D", "error400")
    client = await make_proxy(p, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200  # the first token went out before D answered
    events = sse_events(await resp.text())
    assert json.loads(events[0])["choices"][0]["text"] == "P0"
    assert "D says bad" in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"


async def test_handoff_asleep_decode_is_replaced(make_worker, make_proxy) -> None:
    p = await make_worker("P")
    asleep, awake = await make_worker("D", "asleep"), await make_worker("D")
    client = await make_proxy(p, asleep, awake, first_token_from_prefill=True)
    for _ in range(2):  # round robin: the sleeping worker is tried first at least once
        resp = await client.post("/v1/completions", json=STREAM)
        events = sse_events(await resp.text())
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == \
            ["P0", "t0", "t1", "t2"]
    assert len(awake.received) == 2 and asleep.received
    # The replacement gets the same request: it pulls the KV P holds for that transfer,
    # under a grant naming it.
    by_id = {r["request_id"]: r["body"] for r in awake.received}
    for refused in asleep.received:
        body = by_id[refused["request_id"]]
        grant = body["kv_transfer_params"].pop("grant")
        refused["body"]["kv_transfer_params"].pop("grant")
        assert body == refused["body"]
        assert GrantAuthority(ClusterSecret()).verify(
            grant, transfer_id=refused["request_id"], consumer=awake.zmq_address)
    metrics = await (await client.get("/metrics")).text()
    assert (f'pdserve:proxy_retries_total{{reason="handoff_decode"}} '
            f'{float(len(asleep.received))}') in metrics


async def test_handoff_replacement_prefers_a_decode_worker_to_a_colocated_one(
        make_worker, make_proxy) -> None:
    """With P excluded no (P, D) pair is left, so ordinary routing would pick the colocated
    worker; the replacement is the other D (it pulls P's held KV), and only with no D left
    the colocated one (which recomputes)."""
    p = await make_worker("P")
    asleep, colocated, awake = (await make_worker("D", "asleep"),
                                await make_worker("colocated"), await make_worker("D"))
    client = await make_proxy(p, asleep, colocated, awake, first_token_from_prefill=True)
    for _ in range(2):
        resp = await client.post("/v1/completions", json=STREAM)
        events = sse_events(await resp.text())
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == \
            ["P0", "t0", "t1", "t2"]
    assert asleep.received and not colocated.received and len(awake.received) == 2
    p, asleep, colocated = (await make_worker("P"), await make_worker("D", "asleep"),
                            await make_worker("colocated"))
    client = await make_proxy(p, asleep, colocated, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200 and sse_events(await resp.text())[-1] == "[DONE]"
    assert asleep.received and len(colocated.received) == 1


async def test_an_error_after_the_stream_opened_ends_it_with_an_event(make_proxy) -> None:
    """Whatever fails once the client's headers went out, the stream ends with an SSE error
    event: never a second response written into the open body."""
    client = await make_proxy()

    async def dispatch(request, path, body, transfer_id, timer, generates):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        stream = await open_stream(request, out, WriteBound(60.0, lambda _request: None))
        await stream.write(b'data: {"choices": [{"text": "P0"}]}\n\n')
        raise ModelNotFoundError("every worker of the model left")

    client.server.app[keys.DISPATCHER].dispatch = dispatch
    resp = await client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    text = await resp.text()
    assert "HTTP/1.1" not in text
    events = sse_events(text)
    assert json.loads(events[0])["choices"][0]["text"] == "P0"
    assert "every worker of the model left" in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"


async def test_handoff_p_failure_before_any_byte_is_retried(make_worker, make_proxy) -> None:
    bad, good, d = await make_worker("P", "error500"), await make_worker("P"), await make_worker("D")
    client = await make_proxy(bad, good, d, first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=STREAM)
    events = sse_events(await resp.text())
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["P0", "t0", "t1", "t2"]
    assert len(bad.received) == 1 and len(good.received) == 1 and len(d.received) == 1


async def test_prefix_affinity_routes_shared_prefixes_together(make_worker, make_proxy) -> None:
    ps = [await make_worker("P") for _ in range(3)]
    ds = [await make_worker("D") for _ in range(2)]
    client = await make_proxy(*ps, *ds, routing="prefix_affinity", affinity_prefix_chars=32)
    prefixes = [f"shared document number {i:02d} begins here. " for i in range(12)]
    for round_ in range(3):
        for prefix in prefixes:
            body = {**PROMPT, "prompt": prefix + f"question {round_}"}
            assert (await client.post("/v1/completions", json=body)).status == 200
    for workers in (ps, ds):
        homes: dict[str, set[int]] = {}
        for index, worker in enumerate(workers):
            for received in worker.received:
                homes.setdefault(received["body"]["prompt"][:32], set()).add(index)
        assert all(len(h) == 1 for h in homes.values()), homes  # one home per prefix
        assert sum(1 for w in workers if w.received) > 1  # and the prefixes spread


async def test_tokenize_and_version_at_the_proxy(make_worker, make_proxy) -> None:
    """/tokenize and /detokenize go whole to a decode (or colocated) worker, never to P;
    /version answers from the proxy itself."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "hello"}),
                       ("/detokenize", {"model": MODEL, "tokens": [1, 2]})):
        resp = await client.post(path, json=body)
        assert resp.status == 200
        assert d.received[-1]["path"] == path and d.received[-1]["body"] == body
    assert p.received == []
    version = await (await client.get("/version")).json()
    assert isinstance(version["version"], str) and version["version"]


async def test_models_lists_only_what_a_request_can_be_answered_for(make_worker,
                                                                     make_proxy) -> None:
    """A model with only prefill workers (its decode workers gone or not yet up) gets a 503
    for every request, so /v1/models does not list it; a colocated worker's model is."""
    p = await make_worker("P")
    client = await make_proxy(p)
    assert (await (await client.get("/v1/models")).json())["data"] == []
    assert (await client.post("/v1/completions", json=PROMPT)).status == 503
    c = await make_worker("colocated")
    client = await make_proxy(p, c)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


async def test_a_departed_worker_leaves_no_metric_series(make_worker, make_proxy) -> None:
    """Per-worker series (legs, errors, latency, routing pairs) are dropped when the worker
    deregisters or expires: workers restarting at new ports would otherwise grow /metrics
    for good."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=PROMPT)).status == 200
    text = await (await client.get("/metrics")).text()
    assert p.http_address in text and d.http_address in text
    client.app[keys.REGISTRY].remove(d.http_address)
    text = await (await client.get("/metrics")).text()
    assert d.http_address not in text and p.http_address in text


async def test_a_leg_ending_after_its_worker_left_revives_no_metric_series(
        make_worker, make_proxy) -> None:
    """A worker that deregisters (or expires) while a stream runs has its metric series
    dropped; the leg ending afterwards used to create them again, for good."""
    p, d = await make_worker("P"), await make_worker("D", "slow")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status == 200
    await resp.content.readany()
    client.app[keys.REGISTRY].remove(d.http_address)
    await resp.text()
    text = await (await client.get("/metrics")).text()
    assert [line for line in text.splitlines() if d.http_address in line] == []


async def test_prefix_affinity_routes_a_prompt_with_a_lone_surrogate(make_worker,
                                                                    make_proxy) -> None:
    """Valid JSON may carry a lone surrogate: the routing key hashed it with str.encode(),
    which raised, and the client got a 500 instead of the worker's answer."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, routing="prefix_affinity")
    resp = await client.post("/v1/completions",
                             data=b'{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 4}',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()


def test_sse_tracker_takes_done_only_as_a_line_of_its_own() -> None:
    """Generated text may hold "data: [DONE]" inside an event's JSON: taken for the end, a
    stream cut right after looked complete to the client (no error event)."""
    from proxy.forwarding import SSETracker

    tracker = SSETracker()
    tracker.feed(b'data: {"choices":[{"index":0,"text":"data: [DONE]"}]}\n\n')
    assert not tracker.done_seen
    tracker.feed(b"data: [DO")
    tracker.feed(b"NE]")
    assert not tracker.done_seen  # its line has not ended yet
    tracker.feed(b"\n\n")
    assert tracker.done_seen
