"""Fixtures for proxy tests: fake P/D/colocated workers and a proxy in front of them."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from connectors.p2p_nccl.handshake import ControlServer
from connectors.p2p_nccl.messages import KVPullRequest, make_codec
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.messages import Heartbeat
from engine_core.cluster.trust import ClusterSecret
from engine_core.parallel.kv_layout import KVLayout, PeerRanks
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.registry import InstanceRegistry

MODEL = "tiny"

# The slow worker's pause between events: its streams outlast what a test does mid-way
# (remove a worker, read the metrics) by far, and a test still waits only two seconds.
SLOW_EVENT_S = 0.02


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now (a tensor-parallel
    worker's ranks listen on consecutive ports)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        held = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeWorker:
    """A small aiohttp app that mimics a pdserve worker of one role.

    ``mode``: ok | error500 | broken500 (its body cut off) | error400 | asleep (a sleeping
    worker's 503) | hang | empty |
    no_first_token (a P that ignores ``first_token_events``) |
    fail_mid (D: two events then the connection drops) | no_done (D: stream ends without [DONE]) | slow (D: 100 events, one
    every ``SLOW_EVENT_S``: two seconds a stream) | flood (D: ``flood_bytes`` of events as fast as they are taken) |
    stall_mid (D: two events, then silence) | error_mid (D: two events, then an error event).
    A prefill leg (``do_remote_decode``) is answered with one JSON body, as a real P does.
    A stream's event ``i`` carries text ``t<i>`` and token id ``100 + i``, named in an SSE
    comment when ``stream_token_ids`` is asked for; a continuation (``generated_token_ids``)
    starts after the tokens of its own it names, as a real worker does.
    """

    role: str
    kv_port: int
    mode: str = "ok"
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)  # P: releases it got
    kv_servers: list[ControlServer] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # each call's Authorization
    server: TestServer | None = None
    flood_bytes: int = 32 << 20
    delay_s: float = 0.0  # every answer waits this long first
    card: dict[str, Any] | None = None  # its /v1/models card's extra fields (404 when None)
    listens_kv: bool = True  # P: whether its KV control sockets are up
    kv_tp: int | None = None  # registers KV ranks of this tensor-parallel size (None: none)
    kv_dtype: str = "float32"  # its registered cache dtype

    @property
    def http_address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    @property
    def zmq_address(self) -> str:
        return f"127.0.0.1:{self.kv_port}"

    def heartbeat(self) -> Heartbeat:
        ranks = None if self.kv_tp is None else PeerRanks(
            KVLayout.of_rank(self.kv_tp, 0, 2, 8, 16, self.kv_dtype, 2),
            tuple(f"127.0.0.1:{self.kv_port + r}" for r in range(self.kv_tp)))
        return Heartbeat(role=self.role, http_address=self.http_address, model=MODEL,
                         zmq_address=None if self.role == "colocated" else self.zmq_address,
                         kv_ranks=ranks)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id", "")
        try:  # a leg cut while its body still arrives counts as cancelled too
            body = await request.json()
            self.authorizations.append(request.headers.get("Authorization"))
            self.received.append({"path": request.path, "body": body,
                                  "request_id": request_id})
            return await self._answer(request, body, request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def _answer(self, request: web.Request, body: dict[str, Any],
                      request_id: str) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "error500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "asleep":
            return web.json_response({"error": {
                "message": "the engine is asleep; POST /wake_up first",
                "type": "service_unavailable", "param": None, "code": "engine_sleeping"}},
                status=503)
        if self.mode == "error400":
            return web.json_response({"error": {"message": f"{self.role} says bad",
                                                "type": "invalid_request_error", "param": "n",
                                                "code": None}}, status=400)
        if self.mode == "broken500":  # a 5xx whose body is cut off mid-way
            response = web.StreamResponse(status=500,
                                          headers={"Content-Type": "application/json"})
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b'{"error": {"mess')
            assert request.transport is not None
            request.transport.abort()
            return response
        if self.mode == "empty":
            return web.Response(status=200, body=b"", content_type="application/json")
        # A prefill leg (do_remote_decode) is answered as one JSON body, streamed or not.
        if not body.get("stream") or (body.get("kv_transfer_params") or {}).get(
                "do_remote_decode"):
            # flood on D: an answer of flood_bytes of text (n samples with logprobs are MBs)
            n = 1 if self.role == "P" else self.flood_bytes if self.mode == "flood" else 3
            extra: dict[str, Any] = {}
            if (self.role == "P" and (body.get("kv_transfer_params") or {}).get(
                    "first_token_events") and self.mode != "no_first_token"):
                choices = range(body.get("n") or 1)  # one first token a choice
                extra["pdserve_first_token"] = {"token_ids": [[42] for _ in choices], "events": [
                    {"id": f"cmpl-{request_id}", "choices": [{"index": i, "text": f"P{i}"}]}
                    for i in choices]}
            if self.role == "P" and (body.get("prompt_logprobs") is not None
                                     or body.get("echo")):  # stands for the real columns
                extra["pdserve_prompt_logprobs"] = [{"computed_by": "P", "for": request_id}]
            return web.json_response({
                "id": f"cmpl-{request_id}", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
                "served_by": self.role, **extra,
            })
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "flood":
            return await self._flood(response, request_id)
        count = 100 if self.mode == "slow" else 3
        params = body.get("kv_transfer_params") or {}
        # Its own tokens (100 + i) already sent; a handoff's P token (42) is not one of them.
        held = (params.get("generated_token_ids") or [[]])[0]
        start = sum(1 for t in held if t >= 100)
        for i in range(start, count):
            event = {"id": f"cmpl-{request_id}", "choices": [{"index": 0, "text": f"t{i}"}]}
            comment = f": pdserve_token_ids={100 + i}\n" if params.get("stream_token_ids") else ""
            await response.write(f"{comment}data: {json.dumps(event)}\n\n".encode())
            if self.mode == "slow":
                await asyncio.sleep(SLOW_EVENT_S)
            if i == 1 and self.mode in ("fail_mid", "stall_mid", "error_mid"):
                await asyncio.sleep(0.05)  # let the events reach the proxy first
                if self.mode == "stall_mid":
                    await asyncio.sleep(3600)
                if self.mode == "error_mid":
                    await response.write(b'data: {"error": {"message": "engine died", '
                                         b'"code": 503}}\n\ndata: [DONE]\n\n')
                    return response
                assert request.transport is not None
                request.transport.abort()
                return response
        if self.mode != "no_done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        """A worker's /v1/models: its one model's card (404 without ``card``)."""
        if self.card is None:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "pdserve", **self.card}]})

    def listen_kv(self) -> None:
        """A prefill worker's KV control sockets (one per rank), which take the proxy's
        releases as a real P does: sealed with the cluster secret, each under a grant naming
        this rank and the consumer; recorded in ``releases``."""
        ranks = self.kv_tp or 1
        for rank in range(ranks):
            address = f"127.0.0.1:{self.kv_port + rank}"
            grants = GrantAuthority(ClusterSecret())

            def on_message(message: Any, frames: Any, address: str = address,
                           grants: GrantAuthority = grants) -> None:
                assert isinstance(message, KVPullRequest) and message.num_blocks == 0
                grants.verify(message.grant, transfer_id=message.transfer_id,
                              producer=address, consumer=message.consumer_address)
                self.releases.append({"transfer_id": message.transfer_id,
                                      "producer": address,
                                      "consumer": message.consumer_address})

            server = ControlServer(address, make_codec(ClusterSecret()), on_message,
                                   poll_interval_s=0.01)
            server.start()
            self.kv_servers.append(server)

    async def _flood(self, response: web.StreamResponse, request_id: str) -> web.StreamResponse:
        """Events of 64 KiB each until ``flood_bytes`` went out, then [DONE]: more than every
        buffer between this worker and a client that stopped reading can hold."""
        event = {"id": f"cmpl-{request_id}", "choices": [{"index": 0, "text": "x" * (64 << 10)}]}
        data = f"data: {json.dumps(event)}\n\n".encode()
        for _ in range(max(1, self.flood_bytes // len(data))):
            await response.write(data)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def make_worker() -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    """Start fake workers on 127.0.0.1 ephemeral ports; all stop at the test's end."""
    servers: list[TestServer] = []
    workers: list[FakeWorker] = []

    async def factory(role: str, mode: str = "ok", **fields: Any) -> FakeWorker:
        worker = FakeWorker(role=role, kv_port=free_port_run(fields.get("kv_tp") or 1),
                            mode=mode, **fields)
        if role == "P" and worker.listens_kv:
            worker.listen_kv()
            workers.append(worker)
        app = web.Application()
        app.router.add_post("/v1/completions", worker.handle)
        app.router.add_post("/v1/chat/completions", worker.handle)
        app.router.add_post("/tokenize", worker.handle)
        app.router.add_post("/detokenize", worker.handle)
        app.router.add_get("/v1/models", worker.models)
        worker.server = TestServer(app)
        await worker.server.start_server()
        servers.append(worker.server)
        return worker

    yield factory
    for server in servers:
        await server.close()
    for worker in workers:
        for kv_server in worker.kv_servers:
            kv_server.stop()


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    """Start a proxy app (no ZMQ registration) with the given workers registered."""
    clients: list[TestClient] = []

    async def factory(*workers: FakeWorker, **overrides: Any) -> TestClient:
        # D computes the first token unless a test turns the handoff (the product's
        # default) on: most tests here are about the legs of that path.
        config = ProxyConfig(**{"registration_port": None, "first_token_from_prefill": False,
                                **overrides})
        registry = InstanceRegistry(config.heartbeat_timeout_s, config.suspect_s)
        for worker in workers:
            registry.heartbeat(worker.heartbeat())
        counter = iter(range(1, 1_000_000))
        app = create_app(config, registry=registry, id_factory=lambda: f"id{next(counter)}")
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


async def _wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[None]]:
    """Poll a predicate until it holds (or fail the test after ``timeout_s``)."""
    return _wait_until


@pytest.fixture
def proxy_clock() -> FakeClock:
    """A hand-driven clock for registry and routing tests."""
    return FakeClock()
