"""The shutdown drain waits for every request the server took, from the moment its handler
was admitted (its body still being read or tokenized, the engine not told yet), and past its
deadline a request still on its way to the engine starts nothing: an engine stopped under an
accepted request would lose it, and a prefill worker would exit holding the KV its decode
worker is about to pull. A real engine client over a scripted engine (fast), then a real
server process on the demo checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.launch import free_port
from engine_core.engine_client import AsyncEngineClient
from engine_core.errors import EngineDeadError, ShuttingDownError
from engine_core.messages import EngineOutput
from engine_core.sampling_params import SamplingParams
from engine_core.server.drain import drain
from engine_core.server.readiness import Readiness
from tests.engine_core.test_engine_client import _config, fake_factory
from tests.integration.cluster_harness import child_env, wait_http
from tests.server.conftest import kill_with_engines
from tests.server.test_shutdown import _engine_pids

DRAINED = "Drained: no request in flight, every KV block free"


async def _handler(readiness: Readiness, client: AsyncEngineClient, body_read: asyncio.Event,
                   request_id: str, max_tokens: int) -> list[EngineOutput]:
    """A generation handler as the server runs one: admitted, then its body is read and
    tokenized (until ``body_read``), then the engine runs it."""
    with readiness.admit():
        await body_read.wait()
        return [out async for out in client.generate(request_id, [1, 2, 3],
                                                     SamplingParams(max_tokens=max_tokens))]


async def test_the_drain_waits_for_a_request_admitted_before_the_engine_saw_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "pdserve.server")
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        readiness, body_read = Readiness(), asyncio.Event()
        handler = asyncio.create_task(_handler(readiness, client, body_read, "late", 20))
        await asyncio.sleep(0)  # admitted: the handler waits for its body
        assert readiness.admitted == 1 and client.num_in_flight == 0
        readiness.draining = True
        draining = asyncio.create_task(drain(client, readiness, timeout_s=60))
        await asyncio.sleep(0.3)  # many polls of the drain
        assert not draining.done(), caplog.text
        with pytest.raises(ShuttingDownError):  # and it takes nothing new meanwhile
            with readiness.admit():
                pass
        body_read.set()
        outputs = await asyncio.wait_for(handler, 30)
        assert sum(len(out.new_token_ids) for out in outputs) == 20
        assert outputs[-1].finish_reason == "length"
        await asyncio.wait_for(draining, 30)
        assert readiness.admitted == 0
        assert DRAINED in caplog.text
    finally:
        await client.shutdown()


async def test_past_its_deadline_the_drain_ends_running_requests_and_starts_no_later_one(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "pdserve.server")
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        readiness, running_body, late_body = Readiness(), asyncio.Event(), asyncio.Event()
        running_body.set()
        running = asyncio.create_task(_handler(readiness, client, running_body, "running",
                                               10_000_000))
        late = asyncio.create_task(_handler(readiness, client, late_body, "late", 5))
        while client.num_in_flight == 0:
            await asyncio.sleep(0.01)
        readiness.draining = True
        await asyncio.wait_for(drain(client, readiness, timeout_s=0.5), 30)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await running
        late_body.set()  # its body arrives after the drain gave up: the engine never sees it
        with pytest.raises(EngineDeadError, match="shutting down"):
            await late
        assert readiness.admitted == 0 and client.num_in_flight == 0
        assert "Ending 2 requests still in flight" in caplog.text
    finally:
        await client.shutdown()


# A real engine on the demo checkpoint whose steps take 0.2 s (tests.server.test_shutdown),
# with a drain long enough for the request below.
_SERVER_SCRIPT = """
import sys
from engine_core.config import EngineConfig, ModelConfig
from engine_core.server.api_server import ServerOptions, run_server
from tests.server.test_shutdown import slow_step_engine_factory

run_server(EngineConfig(model=ModelConfig(model=sys.argv[2], max_model_len=256,
                                          served_model_name="demo")),
           ServerOptions(port=int(sys.argv[1]), log_stats_interval_s=0, shutdown_drain_s=60.0),
           slow_step_engine_factory)
"""


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_request_whose_body_arrives_after_sigterm_is_served_before_the_server_exits(
        demo_checkpoint, tmp_path: Path) -> None:
    """Its headers came before the SIGTERM, so the server took it; its body comes after the
    drain began. It is served whole (30 steps of 0.2 s: longer than the grace aiohttp gives
    handlers after the drain), and only then the server exits 0."""
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, str(port),
                                 str(demo_checkpoint)], env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    engines: list[int] = []
    body = json.dumps({"prompt": "drain me", "max_tokens": 30, "ignore_eos": True,
                       "stream": True}).encode()
    try:
        wait_http(url + "/health", time.monotonic() + 120, [proc], [log])
        engines = _engine_pids(proc.pid)
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        with conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:1])
            # The server's loop parsed those headers (and started their handler) before it
            # answers a request sent after them.
            urllib.request.urlopen(url + "/health", timeout=30).read()
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # the drain is running
            conn.sendall(body[1:])
            answer = _read_all(conn)
        proc.wait(90)
        output = log.read_text()
        assert proc.returncode == 0, output
        head, _, events = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), (answer[:500], output)
        assert b"data: [DONE]" in events and b'"finish_reason":"length"' in events, \
            (events[-500:], output)
    finally:
        kill_with_engines(proc, engines)
