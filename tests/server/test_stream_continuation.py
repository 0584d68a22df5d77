"""The worker's half of request migration, on one real server.

A stream asked for ``stream_token_ids`` names each event's output tokens in an SSE comment;
the same request continued with any prefix of them as ``generated_token_ids`` (beyond the
first-token handoff's one, and an empty prefix after a chat's role chunk) streams exactly
the rest: glued to the events sent before the cut, the text, finish reason and usage of the
uninterrupted stream, with one chat role chunk.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from engine_core.server.streaming import TOKEN_IDS_COMMENT
from tests.server.conftest import MODEL_NAME

MSG = [{"role": "user", "content": "tell me about the sea and the ships"}]
CASES = {
    "completions": ("/v1/completions", {"prompt": "The quick brown fox jumps over"}),
    "chat": ("/v1/chat/completions", {"messages": MSG}),
}


def _events(raw: bytes) -> list[tuple[list[int], dict]]:
    """(token ids named, event) of each data event but [DONE]."""
    out = []
    for block in raw.split(b"\n\n"):
        ids: list[int] = []
        if block.startswith(TOKEN_IDS_COMMENT):
            line, _, block = block.partition(b"\n")
            ids = [int(t) for t in line[len(TOKEN_IDS_COMMENT):].split(b",") if t]
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append((ids, json.loads(block[len(b"data: "):])))
    return out


def _text(events: list[dict]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices") or [])


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_stream_cut_anywhere_continues_from_its_token_ids(server, auth, case) -> None:
    path, extra = CASES[case]
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 24, "ignore_eos": True,
            **extra, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + path, json={
                **body, "kv_transfer_params": {"stream_token_ids": True}}) as response:
            assert response.status == 200
            whole = _events(await response.read())
        all_ids = [t for ids, _ in whole for t in ids]
        assert len(all_ids) == 24
        # Cut after the role chunk (no token yet), mid-way, and just before the end.
        for cut in (1 if path.endswith("chat/completions") else 0, len(whole) // 2,
                    len(whole) - 3):
            sent = whole[:cut]
            held = [t for ids, _ in sent for t in ids]
            async with session.post(server.url + path, json={
                    **body, "kv_transfer_params": {"generated_token_ids": [held],
                                                   "stream_token_ids": True}}) as response:
                assert response.status == 200, await response.text()
                rest = _events(await response.read())
            assert held + [t for ids, _ in rest for t in ids] == all_ids, cut
            glued = [e for _, e in sent + rest]
            assert _text(glued) == _text([e for _, e in whole]), cut
            usage, whole_usage = glued[-1]["usage"], whole[-1][1]["usage"]
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert usage[key] == whole_usage[key], (cut, key)  # cached_tokens may differ
            roles = [e for e in glued if (e["choices"] or [{}])[0].get("delta", {}).get("role")]
            assert len(roles) == (1 if path.endswith("chat/completions") else 0)
    assert server.wait_idle().num_running == 0
