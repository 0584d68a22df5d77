"""The proxy's own answers: /ping, /v1/models' cards, bodies with numbers JSON cannot carry."""

from __future__ import annotations

import pytest

from proxy.model_cards import ModelCard, merge, parse_card

MODEL = "tiny"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 8}


async def test_ping_is_health_by_get_and_post(make_worker, make_proxy) -> None:
    """SageMaker's health check, as vLLM serves it: /health's answer."""
    client = await make_proxy(await make_worker("D"))
    health = await (await client.get("/health")).json()
    for method in ("GET", "POST"):
        resp = await client.request(method, "/ping")
        assert resp.status == 200, method
        assert await resp.json() == health


async def test_models_carry_the_workers_cards(make_worker, make_proxy) -> None:
    """root and parent as the workers' own cards say; max_model_len the smallest of the
    model's workers (a request must fit P, which validates it as D does, and D)."""
    p = await make_worker("P", card={"root": "/ckpt/tiny", "parent": None, "max_model_len": 128})
    d = await make_worker("D", card={"root": "/ckpt/tiny", "parent": None, "max_model_len": 256})
    client = await make_proxy(p, d)
    for _ in range(2):  # the second answer comes from the cards kept
        models = await (await client.get("/v1/models")).json()
        (card,) = models["data"]
        assert card["id"] == MODEL and card["object"] == "model"
        assert (card["root"], card["parent"], card["max_model_len"]) == ("/ckpt/tiny", None, 128)
    assert models["object"] == "list"


async def test_models_without_a_card_read_null(make_worker, make_proxy) -> None:
    """A worker that cannot say (an older one, or one that fails) leaves the fields null,
    as vLLM's optional card fields; the list still answers."""
    client = await make_proxy(await make_worker("D"))  # its /v1/models is a 404
    (card,) = (await (await client.get("/v1/models")).json())["data"]
    assert (card["root"], card["parent"], card["max_model_len"]) == (None, None, None)


@pytest.mark.parametrize("answer,want", [
    (b'{"data": [{"id": "tiny", "root": "/r", "parent": "p", "max_model_len": 64}]}',
     ModelCard("/r", "p", 64)),
    (b'{"data": [{"id": "other", "max_model_len": 64}]}', None),
    (b'{"data": [{"id": "tiny", "root": 5, "max_model_len": true}]}', ModelCard()),
    (b'{"data": [{"id": "tiny", "max_model_len": -3}]}', ModelCard()),
    (b'{"data": {"id": "tiny"}}', None), (b"not json", None), (b"[1]", None),
])
def test_a_workers_card_is_validated(answer: bytes, want: ModelCard | None) -> None:
    assert parse_card(answer, MODEL) == want


def test_cards_merge_to_the_smallest_context() -> None:
    merged = merge([ModelCard(None, None, None), ModelCard("/a", None, 512),
                    ModelCard("/b", "base", 256)])
    assert merged == ModelCard("/a", "base", 256)
    assert merge([]) == ModelCard()


@pytest.mark.parametrize("payload,param", [
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": -1e999}', "top_p"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": 1e400}}', "logit_bias"),
    (b'{"model": "tiny", "prompt": "hi", "stream_options": {"x": [1, 2e308]}}',
     "stream_options"),
])
async def test_a_non_finite_number_is_a_400_naming_it(make_worker, make_proxy, payload: bytes,
                                                      param: str) -> None:
    """A literal past the double range parses as infinity; the proxy used to re-serialise
    it as Infinity and the worker called the body "not valid JSON". Refused here, named."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", data=payload,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and "finite" in error["message"], error
    assert "JSON" not in error["message"]
    assert p.received == [] and d.received == []


async def test_large_finite_numbers_pass(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", data=b'{"model": "tiny", "prompt": "hi", '
                             b'"temperature": 1e308, "seed": 100000000000000000000000}',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200
    assert d.received[0]["body"]["temperature"] == 1e308


async def test_cards_are_asked_again_after_their_ttl(make_worker, proxy_clock) -> None:
    """A worker restarted at its address keeps its registration: its card is asked again
    after CARD_TTL_S; one that stops answering keeps the card it last gave."""
    import aiohttp

    from proxy.model_cards import CARD_TTL_S, ModelCards
    from proxy.registry import InstanceRegistry

    d = await make_worker("D", card={"root": "/a", "parent": None, "max_model_len": 64})
    registry = InstanceRegistry()
    registry.heartbeat(d.heartbeat())
    cards = ModelCards(proxy_clock)
    async with aiohttp.ClientSession() as session:
        async def length() -> int | None:
            return (await cards.cards(session, registry.workers(), {}))[MODEL].max_model_len

        assert await length() == 64
        d.card = {"root": "/a", "parent": None, "max_model_len": 32}
        assert await length() == 64  # kept within the TTL
        proxy_clock.advance(CARD_TTL_S + 1)
        assert await length() == 32
        d.card = None  # its /v1/models now fails
        proxy_clock.advance(CARD_TTL_S + 1)
        assert await length() == 32


async def test_ready_says_whether_any_model_can_be_answered(make_worker, make_proxy) -> None:
    """/ready is readiness (503 while no decode or colocated worker is registered: a
    cluster of prefill workers alone answers nothing); /health stays liveness (200)."""
    client = await make_proxy(await make_worker("P"))
    resp = await client.get("/ready")
    assert resp.status == 503
    body = await resp.json()
    assert body["status"] == "not_ready" and body["models"] == []
    assert (await client.get("/health")).status == 200
    served = await make_proxy(await make_worker("P"), await make_worker("D"))
    resp = await served.get("/ready")
    assert resp.status == 200
    assert (await resp.json())["models"] == [MODEL]
