"""The proxy's request path over workers with capabilities (fake workers): placement,
the admin call that changes a worker's capabilities, /instances and the metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from proxy import keys
from tests.proxy.conftest import MODEL

SHORT = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
LONG = {"model": MODEL, "prompt": list(range(1000, 3000)), "max_tokens": 3}


def _placements(text: str) -> dict[tuple[str, str], float]:
    return {(s.labels["placement"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "pdserve:proxy_placements_total"}


def _kv(received: dict[str, Any]) -> dict[str, Any]:
    """A leg's transfer params, less the stream's token naming (every stream asks for it)."""
    params = received["body"].get("kv_transfer_params") or {}
    return {k: v for k, v in params.items() if k != "stream_token_ids"}


async def test_short_prompts_are_served_whole_on_a_worker(make_worker, make_proxy) -> None:
    a, b = await make_worker("worker"), await make_worker("worker")
    client = await make_proxy(a, b)
    for _ in range(4):
        response = await client.post("/v1/completions", json=SHORT)
        assert response.status == 200
    legs = a.received + b.received
    assert len(legs) == 4 and not any(_kv(leg) for leg in legs)
    assert a.received and b.received  # ties rotate
    metrics = await (await client.get("/metrics")).text()
    assert _placements(metrics) == {("local", "short"): 4.0}


async def test_capabilities_change_while_serving(make_worker, make_proxy) -> None:
    a, b = await make_worker("worker"), await make_worker("worker")
    client = await make_proxy(a, b)
    for worker, caps in ((a, ["prefill"]), (b, ["decode"])):
        response = await client.post("/instances/capabilities",
                                      json={"worker": worker.http_address, "capabilities": caps})
        assert response.status == 200
        assert (await response.json())["capabilities"] == caps
    response = await client.post("/v1/completions", json={**LONG, "stream": True})
    assert response.status == 200 and (await response.read()).endswith(b"data: [DONE]\n\n")
    (p_leg,), (d_leg,) = a.received, b.received
    assert _kv(p_leg)["do_remote_decode"] and _kv(p_leg)["remote_kv_address"] == b.zmq_address
    assert _kv(d_leg)["do_remote_prefill"] and _kv(d_leg)["remote_kv_address"] == a.zmq_address
    # The placed workers' legs carry one grant naming them as P and D, as static ones do.
    assert _kv(p_leg)["grant"] == _kv(d_leg)["grant"]
    GrantAuthority(ClusterSecret()).verify(_kv(d_leg)["grant"],
                                           transfer_id=_kv(d_leg)["transfer_id"],
                                           producer=a.zmq_address, consumer=b.zmq_address)
    instances = {w["http_address"]: w for w in
                 (await (await client.get("/instances")).json())["workers"]}
    assert instances[a.http_address]["role_mix"]["total"] == {"prefill": 1}
    assert instances[b.http_address]["role_mix"] == {"in_flight": {"decode": 0},
                                                     "total": {"decode": 1}}
    assert instances[a.http_address]["pending_prefill_tokens"] == 0
    metrics = await (await client.get("/metrics")).text()
    assert _placements(metrics) == {("disaggregated", "decode_only"): 1.0}
    assert f'pdserve:proxy_prefill_predicted_seconds_count{{worker="{a.http_address}"}} 1.0' \
        in metrics
    assert f'pdserve:proxy_prefill_actual_seconds_count{{worker="{a.http_address}"}} 1.0' \
        in metrics
    # Back to everything: short prompts are local again, on either worker.
    for worker in (a, b):
        response = await client.post("/instances/capabilities",
                                     json={"worker": worker.http_address, "capabilities": None})
        assert sorted((await response.json())["capabilities"]) == ["decode", "prefill", "whole"]
    assert (await client.post("/v1/completions", json=SHORT)).status == 200
    assert not _kv((a.received + b.received)[-1])


async def test_a_prefill_only_worker_is_not_servable(make_worker, make_proxy) -> None:
    a = await make_worker("worker")
    client = await make_proxy(a)
    await client.post("/instances/capabilities",
                      json={"worker": a.http_address, "capabilities": ["prefill"]})
    assert (await client.post("/v1/completions", json=SHORT)).status == 503
    assert (await client.get("/ready")).status == 503


async def test_bad_admin_calls_are_refused(make_worker, make_proxy) -> None:
    a = await make_worker("worker")
    client = await make_proxy(a)
    for body in ({"worker": a.http_address, "capabilities": ["fly"]},
                 {"worker": a.http_address, "capabilities": "prefill"},
                 {"worker": 5, "capabilities": None}, {"capabilities": []}):
        response = await client.post("/instances/capabilities", json=body)
        assert response.status == 400, body
    response = await client.post("/instances/capabilities",
                                 json={"worker": "127.0.0.1:1", "capabilities": None})
    assert response.status == 404


async def test_a_worker_leaving_leaves_the_other_serving(make_worker, make_proxy) -> None:
    a, b = await make_worker("worker"), await make_worker("worker")
    client = await make_proxy(a, b)
    registry = client.app[keys.REGISTRY]
    registry.remove(a.http_address)
    for body in (SHORT, LONG, {**LONG, "stream": True}):
        assert (await client.post("/v1/completions", json=body)).status == 200
    assert not a.received and len(b.received) == 3
    assert all(not _kv(leg) for leg in b.received)  # nobody to prefill for it: whole
    tokenized = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
    assert tokenized.status == 200 and b.received[-1]["path"] == "/tokenize"


async def test_static_workers_keep_their_rules(make_worker, make_proxy) -> None:
    """Without a worker with capabilities, P and D keep routing as before (no placement)."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=SHORT)).status == 200
    assert _kv(p.received[0])["do_remote_decode"] and _kv(d.received[0])["do_remote_prefill"]
    assert _placements(await (await client.get("/metrics")).text()) == {}


def test_a_restriction_outlives_heartbeats_and_reregistration(proxy_clock) -> None:
    from engine_core.cluster.messages import Heartbeat
    from proxy.registry import InstanceRegistry

    registry = InstanceRegistry(clock=proxy_clock)
    beat = Heartbeat(role="worker", http_address="h:1", model=MODEL, zmq_address="h:2")
    registry.heartbeat(beat)
    worker = registry.get("h:1")
    assert worker is not None and worker.capabilities == {"prefill", "decode", "whole"}
    assert registry.restrict("h:1", frozenset({"prefill"}))
    registry.heartbeat(beat)
    assert registry.get("h:1").capabilities == {"prefill"}
    registry.heartbeat(Heartbeat(role="worker", http_address="h:1", model=MODEL,
                                 zmq_address="h:3"))  # re-registered at a new KV port
    assert registry.get("h:1").capabilities == {"prefill"}
    assert registry.servable_models() == []
    # A worker that announces fewer capabilities keeps only those the admin allows.
    registry.heartbeat(Heartbeat(role="worker", http_address="h:1", model=MODEL,
                                 zmq_address="h:3", capabilities=["decode"]))
    assert registry.get("h:1").capabilities == set()
    registry.restrict("h:1", None)
    assert registry.get("h:1").capabilities == {"decode"}
    assert registry.servable_models() == [MODEL]


async def test_a_worker_with_no_capability_left_gets_nothing(make_worker, make_proxy) -> None:
    a = await make_worker("worker")
    client = await make_proxy(a)
    await client.post("/instances/capabilities", json={"worker": a.http_address,
                                                       "capabilities": []})
    assert (await client.post("/v1/completions", json=SHORT)).status == 503
    assert not a.received


async def test_placed_prompts_and_finished_streams_feed_the_lane_plan(make_worker,
                                                                       make_proxy) -> None:
    a, b = await make_worker("worker"), await make_worker("worker")
    client = await make_proxy(a, b)
    for _ in range(3):
        response = await client.post("/v1/completions", json={**SHORT, "stream": True})
        assert response.status == 200
        await response.text()
    lanes = (await (await client.get("/instances")).json())["lanes"]
    # Three prompts placed, three streams of three tokens ended; too few for a plan.
    assert lanes["observed"] == {"prompts": 3, "outputs": 3}
    assert lanes["prefill_lane"] is None
    planner = client.app[keys.PLACER].planner
    assert list(planner._outputs) == [3, 3, 3]
