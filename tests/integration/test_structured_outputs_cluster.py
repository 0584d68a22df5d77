"""Structured outputs through a live 1P1D CPU cluster (real processes, the openai client):
P samples the first token under the grammar and, on streams, hands it to D, whose matcher
replays it before its first step. Generated schemas always validate, regex and choice always
match, each answer equals a single worker's, and the cluster ends idle."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jsonschema
import openai
import pytest

from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    idle_violations,
    labelled_counter,
    wait_idle,
)
from tests.structured_schemas import generated_schemas

REGEX = r"[a-z]{1,4}-\d{1,3}"
MAX_TOKENS = 96


def _answer(client: openai.OpenAI, fields: dict, stream: bool) -> str:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                  max_tokens=MAX_TOKENS, temperature=1.0, **fields)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_structured_outputs_through_1p1d(plain_1p1d: Cluster) -> None:
    cluster = plain_1p1d
    schemas = generated_schemas(20, seed=3)
    cases = [({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": schema}}, "seed": i},
              lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
             for i, schema in enumerate(schemas)]
    cases += [({"extra_body": {"guided_regex": REGEX}, "seed": 100 + i},
               lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)) for i in range(4)]
    cases += [({"extra_body": {"structured_outputs": {"choice": ["left", "right"]}},
                "seed": 200 + i}, lambda text: text in ("left", "right") or pytest.fail(text))
              for i in range(4)]
    proxy_address = cluster.url.removeprefix("http://")
    before = labelled_counter(proxy_address, "pdserve:proxy_first_token_handoffs")
    decode = cluster.worker("decode0")
    via_proxy = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0,
                              timeout=120)
    direct = openai.OpenAI(base_url=f"http://{decode.http_address}/v1", api_key="x",
                           max_retries=0, timeout=120)
    fields = [c[0] for c in cases]
    with ThreadPoolExecutor(8) as pool:
        for stream in (True, False):
            got = list(pool.map(partial(_answer, via_proxy, stream=stream), fields))
            want = list(pool.map(partial(_answer, direct, stream=stream), fields))
            for (given, check), text, single in zip(cases, got, want, strict=True):
                check(text)
                assert text == single, (given, text, single)
    handoffs = labelled_counter(proxy_address, "pdserve:proxy_first_token_handoffs")
    # P's token went first
    assert handoffs.get("prefill", 0) - before.get("prefill", 0) >= len(cases), handoffs
    scraped = wait_idle([w.http_address for w in cluster.workers], 30.0)
    assert not idle_violations(scraped), idle_violations(scraped)
