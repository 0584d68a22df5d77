"""Refused requests leave no KV pinned on a prefill worker (real 1P1D processes on CPU).

A request the cluster refuses must not leave P holding the prompt's KV for a pull that
never comes (until its 60 s lease): P validates the client's own request as D does (the
proxy sends P the client's fields), so what D refuses P refuses first, computing nothing;
and what P accepts but D refuses (their configs differ: here D's context is shorter) is
released as soon as D refused (the proxy tells P's KV control socket). The first-token handoff (the default) likewise,
and a client that leaves once it has P's token frees P's KV at once too.
Besides: a first token that stops the request streams through the handoff as directly, and
the proxy's model card is the workers'. One cluster serves every test of the module.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    Req,
    build_tiny_checkpoint,
    get_json,
    idle_violations,
    labelled_counter,
    run_all,
    scrape,
    wait_idle,
)

D_MAX_MODEL_LEN = 192  # P keeps the harness's 256
PROMPT_IDS = list(range(1, 106))  # 105 tokens
IDLE_S = 15.0  # well under P's 60 s lease: only a release frees it this soon


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("refusals")
    ckpt = build_tiny_checkpoint(root / "ckpt")
    built = Cluster.build(root / "logs", ckpt, num_prefill=1, num_decode=1)
    decode = built.worker("decode0")
    index = len(decode.argv) - 1 - decode.argv[::-1].index("--max-model-len")
    decode.argv[index + 1] = str(D_MAX_MODEL_LEN)
    try:
        built.start([built.proxy, *built.workers])
        built.wait_ready(built.workers)
        yield built
    finally:
        built.stop()


def _addresses(cluster: Cluster) -> tuple[str, str]:
    return cluster.worker("prefill0").http_address, cluster.worker("decode0").http_address


def _assert_idle_soon(cluster: Cluster) -> float:
    """Seconds until P and D read idle (no KV held, no transfer state); fails past IDLE_S."""
    started = time.monotonic()
    scraped = wait_idle(list(_addresses(cluster)), IDLE_S)
    assert not idle_violations(scraped), (idle_violations(scraped), cluster.logs())
    return time.monotonic() - started


def _completion(body: dict, stream: bool = False) -> Req:
    body = {"model": MODEL, **body}
    if stream:
        body["stream"] = True
    return Req("/v1/completions", stream, body, 0)


def _chat(body: dict, stream: bool = False) -> Req:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 60}], **body}
    if stream:
        body["stream"] = True
    return Req("/v1/chat/completions", stream, body, 0)


def _refused_by_both() -> list[Req]:
    """Requests every worker refuses (the reviewer's cases), plain and streamed (handoff)."""
    reqs = []
    for stream in (False, True):
        reqs += [_completion({"prompt": PROMPT_IDS, "max_tokens": 250}, stream),
                 _completion({"prompt": PROMPT_IDS, "max_tokens": "abc"}, stream),
                 _completion({"prompt": PROMPT_IDS, "max_tokens": 8, "n": 0}, stream),
                 _completion({"prompt": PROMPT_IDS, "max_tokens": 8, "min_tokens": -1}, stream),
                 _chat({"max_completion_tokens": 250}, stream)]
    reqs.append(_completion({"prompt": PROMPT_IDS, "max_tokens": 8,
                             "stream_options": {"include_usage": True}}))
    return reqs * 3


def test_requests_every_worker_refuses_compute_nothing_on_p(cluster: Cluster) -> None:
    prefill, _ = _addresses(cluster)
    before = scrape(prefill)["vllm:prompt_tokens_total"]
    outcomes = run_all(cluster.url, _refused_by_both(), concurrency=8)
    for outcome in outcomes:
        assert outcome.status == 400, outcome
        assert outcome.error, outcome
    # P refused them itself, before its engine saw them: no prompt token computed there.
    assert scrape(prefill)["vllm:prompt_tokens_total"] == before
    _assert_idle_soon(cluster)


def test_what_only_d_refuses_is_released_at_once(cluster: Cluster) -> None:
    """D's context is shorter than P's: P computes these prompts, D refuses them (before,
    after or, for the handoff, once P's token streamed), and P's KV is released within
    seconds, never waiting for the lease."""
    prefill, _ = _addresses(cluster)
    fits_p_only = {"prompt": PROMPT_IDS, "max_tokens": 100, "ignore_eos": True}
    reqs = [_completion(fits_p_only), _completion({**fits_p_only, "prompt": [PROMPT_IDS] * 2}),
            _chat({"max_tokens": 100}), _completion(fits_p_only, stream=True),
            _chat({"max_tokens": 100}, stream=True)] * 4
    before = scrape(prefill)["vllm:prompt_tokens_total"]
    outcomes = run_all(cluster.url, reqs, concurrency=6)
    for req, outcome in zip(reqs, outcomes, strict=True):
        if req.stream:  # P's token went out first: D's refusal ends the stream
            assert outcome.status == 200 and outcome.done, outcome
        else:
            assert outcome.status == 400, outcome
        assert "maximum context length is 192" in (outcome.error or ""), outcome
    assert scrape(prefill)["vllm:prompt_tokens_total"] > before  # P did compute them
    _assert_idle_soon(cluster)
    released = scrape(cluster.url.removeprefix("http://")).get(
        "pdserve:proxy_kv_releases_total", 0)
    assert released >= len(reqs), released


async def _take_first_event_and_leave(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
            return await response.content.readuntil(b"\n\n")


def test_a_handoff_client_leaving_after_ps_token_frees_ps_kv(cluster: Cluster) -> None:
    """The client reads P's first token and leaves while D's leg is on its way: whoever
    holds the prompt's KV then (P, for a D that did not take the request yet) frees it at
    once, never at the lease's end."""
    body = {"model": MODEL, "prompt": PROMPT_IDS[:60], "max_tokens": 60, "ignore_eos": True,
            "stream": True}

    async def leave_many() -> list[bytes]:
        firsts = []
        for _ in range(6):  # one at a time: each leaves right after its first event
            firsts.append(await _take_first_event_and_leave(cluster.url, body))
        firsts += await asyncio.gather(*(_take_first_event_and_leave(cluster.url, body)
                                         for _ in range(6)))
        return firsts

    for first in asyncio.run(leave_many()):
        event = json.loads(first.removeprefix(b"data: "))
        assert event["choices"][0]["text"] is not None
    _assert_idle_soon(cluster)


async def _leave_after(url: str, body: dict, seconds: float) -> None:
    async with aiohttp.ClientSession() as session:
        try:
            await asyncio.wait_for(session.post(url + "/v1/completions", json=body), seconds)
        except asyncio.TimeoutError:
            pass


def test_clients_leaving_while_p_computes_leave_p_idle(cluster: Cluster) -> None:
    """Clients leave while their prompts wait in P's engine (stopped meanwhile), streamed
    (the handoff) and not: each P leg is cut and its KV released by the proxy, so P reads
    idle within seconds once it runs again, whether its save came before the abort or not."""
    prefill = cluster.worker("prefill0")
    bodies = [{"model": MODEL, "prompt": PROMPT_IDS[:80 + i], "max_tokens": 8,
               "stream": i % 2 == 0} for i in range(8)]

    async def leave_all() -> None:
        await asyncio.gather(*(_leave_after(cluster.url, body, 1.0) for body in bodies))

    proxy = cluster.url.removeprefix("http://")
    before = labelled_counter(proxy, "pdserve:proxy_kv_releases").get("released", 0)
    cluster.signal_engine(prefill, signal.SIGSTOP)
    try:
        asyncio.run(leave_all())
    finally:
        cluster.signal_engine(prefill, signal.SIGCONT)
    _assert_idle_soon(cluster)
    deadline = time.monotonic() + 10.0  # the releases finish once P's sockets answer
    while True:
        released = labelled_counter(proxy, "pdserve:proxy_kv_releases").get("released", 0)
        if released - before == len(bodies) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert released - before == len(bodies), (before, released)  # each client that left


def test_the_proxys_model_card_is_the_workers(cluster: Cluster) -> None:
    """/v1/models at the proxy: the workers' root and parent, and the context every worker
    a request crosses accepts (D's, the shorter)."""
    (card,) = get_json(f"{cluster.url}/v1/models")["data"]
    (worker_card,) = get_json(f"http://{_addresses(cluster)[0]}/v1/models")["data"]
    assert card["id"] == MODEL
    assert card["root"] == worker_card["root"] and card["parent"] is None
    assert card["max_model_len"] == D_MAX_MODEL_LEN


async def _events(url: str, path: str, body: dict) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            assert response.status == 200, await response.text()
            raw = await response.read()
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def _summary(events: list[dict]) -> tuple[str, str | None, int | str | None]:
    """(text, finish_reason, stop_reason) of a stream's events."""
    text, finish, stop = "", None, None
    for event in events:
        assert "error" not in event, event
        for choice in event.get("choices") or []:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
    return text, finish, stop


STOPPING_FIRST_TOKEN = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "allowed_token_ids": [50], "stop_token_ids": [50]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "allowed_token_ids": [50], "stop_token_ids": [50],
                              "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [0],
                         "skip_special_tokens": False}),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [0], "skip_special_tokens": False,
                         "include_stop_str_in_output": True}),
]


def test_a_first_token_that_stops_streams_through_the_handoff_as_directly(
        cluster: Cluster) -> None:
    """P's sampled token ends the request (a stop id, EOS): the handoff stream has the
    direct stream's text (the stopping token's dropped, or kept with
    include_stop_str_in_output), finish reason and stop reason. Before, P's events sent
    the stopping token's text ("P", "<|endoftext|>")."""
    proxy = cluster.url.removeprefix("http://")
    decode = f"http://{_addresses(cluster)[1]}"

    async def compare() -> None:
        for path, extra in STOPPING_FIRST_TOKEN:
            body = {"model": MODEL, "max_tokens": 4, **extra, "stream": True}
            want = _summary(await _events(decode, path, body))
            got = _summary(await _events(cluster.url, path, body))
            assert want[1] == "stop", (body, want)
            assert got == want, (body, got, want)

    counter = "pdserve:proxy_first_token_handoffs"
    handoffs = labelled_counter(proxy, counter).get("prefill", 0)
    asyncio.run(compare())
    # Every one took the handoff (P's token streamed, D continued after it).
    assert labelled_counter(proxy, counter)["prefill"] - handoffs == len(STOPPING_FIRST_TOKEN)
    _assert_idle_soon(cluster)
