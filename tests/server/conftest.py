"""A real API server (engine-core child process + aiohttp) on 127.0.0.1 for the server tests.

The server runs on its own event loop in a background thread, so every test (sync or
async, any event loop) talks to it over real HTTP. One server per session keeps the suite
fast; tests that need a clean engine poll its stats back to the initial state.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.messages import EngineStats

API_KEY = "test-key"
MODEL_NAME = "demo"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 1024
BODY_LIMIT = 1 << 20


def engine_kwargs() -> dict[str, Any]:
    """The engine settings of the test server, as ``LLM(...)`` keyword arguments."""
    return {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": NUM_BLOCKS,
            "max_num_seqs": 256, "served_model_name": MODEL_NAME}


class ServerHandle:
    """An API server on a background thread's event loop."""

    def __init__(self, config: EngineConfig, options: Any, engine_factory: Any = None) -> None:
        """``engine_factory``: a picklable stand-in for the engine (``EngineFactory``)."""
        from engine_core.server.api_server import app_runner, start_engine_and_app

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> tuple[Any, web.AppRunner, int]:
            client, app = await start_engine_and_app(config, options, engine_factory)
            runner = app_runner(app, options)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return client, runner, site._server.sockets[0].getsockname()[1]

        self.client, self._runner, self.port = self.run(start(), timeout=180)
        self.url = f"http://127.0.0.1:{self.port}"
        self.initial_free_blocks = self.client.info.num_free_blocks

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> EngineStats:
        return self.run(self.client.get_stats())

    def wait_idle(self, deadline_s: float = 30.0) -> EngineStats:
        """Poll engine stats until no request runs and every block is free again."""
        deadline = time.monotonic() + deadline_s
        while True:
            stats = self.stats()
            idle = (stats.num_running == 0 and stats.num_waiting == 0
                    and stats.num_free_blocks == self.initial_free_blocks)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self.client.shutdown()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo-size checkpoint (the embedded demo model's shape and seed) in a temp dir."""
    from engine_core.demo_model import DEMO_ARGS, build_checkpoint

    return Path(build_checkpoint(tmp_path_factory.mktemp("demo"), **DEMO_ARGS))


def demo_engine_config(checkpoint: Path, max_num_seqs: int | None = None) -> EngineConfig:
    """The test server's engine settings on ``checkpoint`` (``engine_kwargs``)."""
    kwargs = engine_kwargs()
    return EngineConfig(
        model=ModelConfig(model=str(checkpoint), max_model_len=kwargs["max_model_len"],
                          served_model_name=kwargs["served_model_name"]),
        cache=CacheConfig(num_gpu_blocks_override=kwargs["num_gpu_blocks_override"]),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs or kwargs["max_num_seqs"]))


def kill_with_engines(proc: Any, engines: list[int]) -> None:
    """SIGKILL a server process still running and the engine processes it started."""
    import os
    import signal

    from tests.integration.cluster_harness import alive

    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    for pid in engines:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server(demo_checkpoint: Path) -> ServerHandle:
    from engine_core.server.api_server import ServerOptions

    config = demo_engine_config(demo_checkpoint)
    options = ServerOptions(api_key=API_KEY, client_max_size=BODY_LIMIT, log_stats_interval_s=0)
    handle = ServerHandle(config, options)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def offline_llm(demo_checkpoint: Path) -> Any:
    """The offline ``LLM`` on the same checkpoint and settings, for output equality."""
    from engine_core.llm import LLM

    return LLM(str(demo_checkpoint), **engine_kwargs())




@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
