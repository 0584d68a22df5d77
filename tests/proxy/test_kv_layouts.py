"""The proxy hands each leg its peer's KV ranks (layout and every rank's connector address,
as the peer registered them) and refuses a pair whose layouts cannot be mapped with a 400
before either leg leaves."""

from __future__ import annotations

from engine_core.parallel.kv_layout import PeerRanks

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 8}


def _params(worker) -> dict:
    (call,) = worker.received
    return call["body"]["kv_transfer_params"]


async def test_each_leg_names_the_peers_ranks(make_worker, make_proxy) -> None:
    p, d = await make_worker("P", kv_tp=2), await make_worker("D", kv_tp=1)
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 200
    to_p, to_d = _params(p), _params(d)
    assert PeerRanks.from_wire(to_p["remote_ranks"]) == d.heartbeat().kv_ranks
    assert PeerRanks.from_wire(to_d["remote_ranks"]) == p.heartbeat().kv_ranks
    assert to_d["remote_ranks"]["addresses"] == [p.zmq_address, f"127.0.0.1:{p.kv_port + 1}"]


async def test_an_unmappable_pair_is_a_400_before_any_leg(make_worker, make_proxy) -> None:
    p = await make_worker("P", kv_tp=2)
    d = await make_worker("D", kv_tp=1, kv_dtype="bfloat16")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json=PROMPT)
    assert resp.status == 400
    assert "cache dtype" in (await resp.json())["error"]["message"]
    assert p.received == [] and d.received == []
    metrics = await (await client.get("/metrics")).text()
    assert "pdserve:proxy_kv_layout_refusals_total 1.0" in metrics


async def test_a_release_names_the_producers_ranks(make_worker, make_proxy, wait_until) -> None:
    p = await make_worker("P", kv_tp=2)
    d = await make_worker("D", "error400", delay_s=0.3, kv_tp=1)
    client = await make_proxy(p, d)
    assert (await client.post("/v1/completions", json=PROMPT)).status == 400
    await wait_until(lambda: len(p.releases) == 2)  # each P rank holds one head for D
    assert sorted(r["producer"] for r in p.releases) == list(p.heartbeat().kv_ranks.addresses)
    assert {r["consumer"] for r in p.releases} == {d.zmq_address}
