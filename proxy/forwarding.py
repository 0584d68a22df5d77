"""Upstream legs: request bodies for P and D, sending with deadlines, reading and relaying.

Everything here talks to one worker at a time and turns aiohttp's many failure types into
``UpstreamError`` / ``UpstreamTimeoutError``; the choice of what to do about a failure
(retry, decode-only, 502, SSE error event) belongs to ``proxy.dispatcher``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from engine_core.errors import InvalidRequestError, UpstreamError, UpstreamTimeoutError
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.parallel.kv_layout import PeerRanks, layout_mismatch
from engine_core.server.protocol import stream_options
from proxy.prefix_index import chat_text

# Client headers worth passing on to workers; the rest (Host, Content-Length, ...) are the
# proxy's own business.
FORWARDED_HEADERS = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "User-Agent")
SSE_CONTENT_TYPE = "text/event-stream"
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class LegTimeouts:
    """Per-leg deadlines in seconds.

    ``prefill_s`` bounds the whole prefill leg. ``decode_s`` bounds each wait for bytes from
    D, a whole non-streamed answer included. A streamed leg has tighter ones, after which
    it is continued elsewhere (``proxy/migration.py``): ``first_byte_s`` for its first
    event (from when its prompt's KV is ready: P answered, or the leg left when D computes
    the prompt itself) and ``stall_s`` between events, so a worker that accepts and never
    answers is found within seconds. ``connect_s`` bounds connecting.
    """

    prefill_s: float = 60.0
    decode_s: float = 600.0
    connect_s: float = 5.0
    first_byte_s: float = 30.0
    stall_s: float = 30.0

    def prefill(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.prefill_s, sock_connect=self.connect_s)

    def decode(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s,
                                     sock_read=self.decode_s)


def create_upstream_session(api_key: str | None = None) -> aiohttp.ClientSession:
    """One pooled session for all worker legs (no per-host cap: --max-inflight bounds us).
    With the proxy's ``api_key``, every call to a worker carries it (the cluster's one key;
    a client's forwarded ``Authorization`` passed the proxy's check, so it is the same)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False, headers=headers)


def _without_transfer_fields(body: dict[str, Any]) -> dict[str, Any]:
    # The proxy owns kv_transfer_params; a client's own value never reaches a worker.
    out = copy.copy(body)
    out.pop("kv_transfer_params", None)
    return out


def producer_body(body: dict[str, Any], transfer_id: str, decode_kv_address: str, grant: str,
                  first_token_events: bool = False,
                  decode_ranks: PeerRanks | None = None) -> dict[str, Any]:
    """P's request, plain or handoff: the client's own fields (``max_tokens``, ``n``,
    ``min_tokens``, ``stream``, ``stream_options``, ...) plus transfer params marking a
    prefill whose KV D pulls.

    P validates the request exactly as D will, so one D would refuse is refused before any
    KV is computed and held for a pull that never comes; only then does P limit what it
    runs (one sample, one token, its answer one JSON body: the server's ``prefill_only``).
    ``first_token_events``: P's answer also carries the stream events of that token.
    ``grant``: the signed transfer grant naming P and D (both legs carry the same one).
    ``decode_ranks``: D's layout and rank addresses, as D registered them.
    """
    out = _without_transfer_fields(body)
    out["kv_transfer_params"] = KVTransferParams(
        transfer_id=transfer_id, do_remote_decode=True, remote_kv_address=decode_kv_address,
        grant=grant, first_token_events=first_token_events,
        remote_ranks=decode_ranks).to_wire()
    return out


def same_kv_layout(a: PeerRanks | None, b: PeerRanks | None) -> bool:
    """Whether two decode workers take a prompt's KV in the same routes, so the saves a P
    made for one serve the other: the same tensor-parallel size and model shape (a worker
    that registered no ranks is one rank)."""
    if a is None or b is None:
        return (1 if a is None else a.layout.tp_size) == (1 if b is None else b.layout.tp_size)
    return (a.layout.tp_size, a.layout.model_shape) == (b.layout.tp_size, b.layout.model_shape)


def layout_refusal(prefill: PeerRanks | None, decode: PeerRanks | None) -> str | None:
    """Why a prefill worker of ranks ``prefill`` cannot fill a decode worker of ranks
    ``decode`` (their registered layouts do not map), or None. A worker that registered no
    layout is one rank of unknown shape: its peer's engine checks the transfer."""
    if prefill is None or decode is None:
        return None
    return layout_mismatch(prefill.layout, decode.layout)


def prefill_body(body: dict[str, Any], transfer_id: str, decode_kv_address: str,
                 grant: str, decode_ranks: PeerRanks | None = None) -> dict[str, Any]:
    """P's request while D's leg runs alongside: P's answer only says the KV is ready."""
    return producer_body(body, transfer_id, decode_kv_address, grant,
                         decode_ranks=decode_ranks)


def decode_body(body: dict[str, Any], transfer_id: str, prefill_kv_address: str | None,
                grant: str | None = None,
                generated_token_ids: list[list[int]] | None = None,
                prefill_ranks: PeerRanks | None = None) -> dict[str, Any]:
    """D's request: the original body, plus transfer params naming P (and the grant) unless
    decode-only; a stream's events name their tokens, for migration (``proxy/migration.py``).
    ``generated_token_ids``: each choice's tokens P sampled, which D continues after.
    ``prefill_ranks``: P's layout and rank addresses, as P registered them."""
    out = _without_transfer_fields(body)
    remote = prefill_kv_address is not None
    params = KVTransferParams(
        transfer_id=transfer_id if remote else None, do_remote_prefill=remote,
        remote_kv_address=prefill_kv_address, grant=grant if remote else None,
        generated_token_ids=None if generated_token_ids is None
        else tuple(tuple(ids) for ids in generated_token_ids),
        stream_token_ids=body.get("stream") is True,
        remote_ranks=prefill_ranks if remote else None).to_wire()
    if params:
        out["kv_transfer_params"] = params
    return out


def continuation_body(body: dict[str, Any], generated_token_ids: list[int]) -> dict[str, Any]:
    """A migrated request's: the client's, continuing its one choice after the output tokens
    the client holds; the worker computes the prompt itself."""
    out = _without_transfer_fields(body)
    out["kv_transfer_params"] = KVTransferParams(
        generated_token_ids=(tuple(generated_token_ids),), stream_token_ids=True).to_wire()
    return out


def prompt_transfer_ids(path: str, body: dict[str, Any], transfer_id: str) -> list[str]:
    """The transfer ids a request's prompts move under, as the workers derive them: the
    request's own, or ``T-p<i>`` for each prompt of a completions batch."""
    prompt = body.get("prompt") if path != CHAT_PATH else None
    if not isinstance(prompt, list) or not prompt or all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [transfer_id]  # one prompt (text, token ids), or chat's messages
    if len(prompt) == 1:
        return [transfer_id]
    return [f"{transfer_id}-p{i}" for i in range(len(prompt))]


def affinity_key(path: str, body: dict[str, Any], num_chars: int) -> str | None:
    """The first ``num_chars`` characters of a request's prompt (chat: its messages as
    role and text), which requests sharing a system prompt or few-shot prefix share; None
    when there is no single prompt to key on (a batch, a malformed body: the worker judges
    it). Token-id prompts key on their first ``num_chars // 4`` ids."""
    if path == CHAT_PATH:
        text = chat_text(body.get("messages"))
        return None if text is None else text[:num_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:num_chars]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "ids:" + ",".join(str(t) for t in prompt[:max(1, num_chars // 4)])
    return None


# ---- first-token handoff: P's sampled token is streamed at once, D continues after it ---

# P sends at most a chat role chunk and, for its one token, a content chunk or a tool
# call's first delta and its first argument characters, a choice.
EVENTS_PER_CHOICE = 3


def handoff_refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why this request cannot take the first-token handoff, or None when it can.

    Only streams gain (a non-streaming answer waits for the last token anyway). Everything
    else a stream carries crosses over: each choice's first token, its logprobs and its
    stop-string hold-back (D replays the token through the same rules). Left to D alone:
    echo (P's events would lack the prompt), per-chunk usage and prompt batches.
    """
    if body.get("stream") is not True:
        return "not_streaming"
    if body.get("echo"):
        return "echo"
    try:
        _, _, continuous_usage = stream_options(body)
    except InvalidRequestError:  # D will refuse it: no token may stream before that 400
        return "stream_options"
    if continuous_usage:
        return "continuous_usage"  # P's events would lack the usage every chunk must carry
    if path != CHAT_PATH:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            return "prompt_batch"
    return None


def handoff_prefill_body(body: dict[str, Any], transfer_id: str,
                         decode_kv_address: str, grant: str,
                         decode_ranks: PeerRanks | None = None) -> dict[str, Any]:
    """P's request when its token is streamed: the first events in its answer too."""
    return producer_body(body, transfer_id, decode_kv_address, grant, first_token_events=True,
                         decode_ranks=decode_ranks)


def handoff_decode_body(body: dict[str, Any], transfer_id: str, prefill_kv_address: str,
                        generated_token_ids: list[list[int]], grant: str,
                        prefill_ranks: PeerRanks | None = None) -> dict[str, Any]:
    """D's request continuing each choice after P's token for it, the prompt's KV pulled
    from P."""
    return decode_body(body, transfer_id, prefill_kv_address, grant, generated_token_ids,
                       prefill_ranks)


@dataclass(frozen=True)
class FirstToken:
    """P's sampled token of each choice and the SSE events that carry them to the client."""

    token_ids: list[list[int]]
    events: bytes


def num_choices(body: dict[str, Any]) -> int:
    """The request's ``n`` (a single prompt's choices; the workers validated it)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def first_token_of(answer: bytes, choices: int) -> FirstToken | None:
    """The ``pdserve_first_token`` of P's JSON answer: one token for each of ``choices``;
    None when absent or malformed (the request then goes on without the handoff: D
    computes its first tokens itself)."""
    try:
        value = json.loads(answer).get("pdserve_first_token")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    token_ids, events = value.get("token_ids"), value.get("events")
    if (not isinstance(token_ids, list) or len(token_ids) != choices
            or any(not isinstance(ids, list) or len(ids) != 1 for ids in token_ids)
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                   for ids in token_ids for t in ids)
            or not isinstance(events, list) or len(events) > EVENTS_PER_CHOICE * choices
            or any(not isinstance(e, dict) for e in events)):
        return None
    data = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
                    for e in events)
    return FirstToken([list(ids) for ids in token_ids], data)


def leg_headers(client_headers: Any, transfer_id: str) -> dict[str, str]:
    """Headers for a worker leg: the forwarded client headers plus X-Request-Id."""
    headers = {name: client_headers[name] for name in FORWARDED_HEADERS if name in client_headers}
    headers["X-Request-Id"] = transfer_id
    return headers


def _upstream_error(exc: BaseException, url: str) -> UpstreamError:
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts subclass it
        return UpstreamTimeoutError(f"worker {url} did not answer in time")
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.InvalidURL)):
        why = getattr(exc, "os_error", exc)
        return UpstreamError(f"cannot connect to worker {url}: {why}", kind="connect",
                             connect_failed=True)
    return UpstreamError(f"worker {url} failed: {type(exc).__name__}: {exc}", kind="disconnect")


async def open_leg(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   headers: dict[str, str], timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
    """POST and return the response once its headers arrived; the caller must close it."""
    try:
        return await session.post(url, json=body, headers=headers, timeout=timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _upstream_error(exc, url) from exc


async def read_body(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """Read a whole response body (bounded) or raise UpstreamError."""
    url = str(response.url)
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > max_bytes:
                raise UpstreamError(f"worker {url} answered more than {max_bytes} bytes",
                                    kind="status")
            chunks.append(chunk)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _upstream_error(exc, url) from exc
    return b"".join(chunks)


async def read_chunk(response: aiohttp.ClientResponse) -> bytes:
    """The next bytes of a streamed body, b"" at its end, or UpstreamError."""
    try:
        return await response.content.readany()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _upstream_error(exc, str(response.url)) from exc


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    """Whether the worker answered with server-sent events."""
    return response.content_type == SSE_CONTENT_TYPE


class SSETracker:
    """Watches relayed SSE bytes: are we between events, and did ``data: [DONE]`` pass?"""

    _DONE = b"data: [DONE]"

    def __init__(self) -> None:
        self._tail = b""
        self.done_seen = False

    def feed(self, chunk: bytes) -> None:
        """Account for bytes just written to the client. ``[DONE]`` counts only as a line of
        its own: generated text may contain "data: [DONE]" inside an event's JSON, and
        taken for the end it made a stream cut right after look complete."""
        window = self._tail + chunk
        start = 0
        while (found := window.find(self._DONE, start)) >= 0:
            end = found + len(self._DONE)
            line_start = found == 0 or window[found - 1:found] == b"\n"
            if line_start and window[end:end + 1] in (b"\n", b"\r"):
                self.done_seen = True
            start = end
        self._tail = window[-(len(self._DONE) + 2):]

    @property
    def at_event_boundary(self) -> bool:
        """True when the bytes so far end with a blank line (or nothing was sent)."""
        return not self._tail or self._tail.endswith((b"\n\n", b"\r\n\r\n"))
