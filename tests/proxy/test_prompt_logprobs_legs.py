"""A request asking for prompt logprobs: D's leg leaves once P answered, carrying P's
prompt logprobs in its kv_transfer_params; other requests' legs leave together."""

from __future__ import annotations

import pytest

from engine_core.kv_transfer_params import PROMPT_LOGPROBS
from tests.proxy.conftest import MODEL

PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 8}


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 2}, {"echo": True, "logprobs": 1},
                                   {"echo": True, "logprobs": 1, "stream": True}])
@pytest.mark.parametrize("handoff", [False, True])
async def test_decode_leg_carries_the_prefill_workers_prompt_logprobs(
        make_worker, make_proxy, extra, handoff) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    p.delay_s = 0.2  # D's leg would have left long before P's answer, were it not held
    client = await make_proxy(p, d, first_token_from_prefill=handoff)
    resp = await client.post("/v1/completions", json={**PROMPT, **extra})
    assert resp.status == 200
    await resp.read()
    (p_req,), (d_req,) = p.received, d.received
    assert "first_token_events" not in p_req["body"]["kv_transfer_params"]
    params = d_req["body"]["kv_transfer_params"]
    assert params[PROMPT_LOGPROBS] == [{"computed_by": "P", "for": p_req["request_id"]}]
    assert params["do_remote_prefill"] is True


async def test_other_requests_carry_none(make_worker, make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    for extra in ({"logprobs": 1}, {"echo": True}):
        resp = await client.post("/v1/completions", json={**PROMPT, **extra})
        assert resp.status == 200
    assert all(PROMPT_LOGPROBS not in r["body"]["kv_transfer_params"] for r in d.received)
