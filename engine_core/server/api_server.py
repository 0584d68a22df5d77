"""The worker's OpenAI-compatible HTTP server (aiohttp) in front of an engine-core process.

``build_app`` wires routes over an already started ``AsyncEngineClient``; ``serve`` starts
the engine, loads the tokenizer, listens, and shuts everything down on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from engine_core.config import EngineConfig
from engine_core.engine_client import DEFAULT_STARTUP_TIMEOUT_S, AsyncEngineClient
from engine_core.engine_process import EngineFactory
from engine_core.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
)
from engine_core.grammar.prefetch import GrammarEngineImport
from engine_core.models.generation_config import GenerationDefaults, load_generation_defaults
from engine_core.server import protocol
from engine_core.server.api_key import api_key_middleware
from engine_core.server.client_request import request_id_of
from engine_core.server.drain import drain
from engine_core.server.http_errors import REQUEST_ID_KEY, error_middleware
from engine_core.server.http_runner import DEFAULT_HEADER_TIMEOUT_S, EdgeAppRunner
from engine_core.server.json_parser import JsonParser
from engine_core.server.loop_watch import LoopWatch
from engine_core.server.metrics import ServerMetrics
from engine_core.server.readiness import Readiness
from engine_core.server.request_body import read_json_body
from engine_core.server.serving import OpenAIServing
from engine_core.server.tokenization import TokenizerService, preload_hf_tokenizer
from engine_core.server.tools import ToolCallOptions
from engine_core.version import package_version

logger = logging.getLogger("pdserve.server")

SERVING_KEY = web.AppKey("serving", OpenAIServing)
HEALTH_TIMEOUT_S = 10.0  # a /health the engine core does not answer in this long is a 503
# /metrics asks the engine for fresh stats this long at most, then renders the last ones it
# pushed: a scrape must not wait behind a long step or a wake-up (Prometheus gives up at 10 s).
METRICS_STATS_TIMEOUT_S = 1.0
# After the drain, handlers still running get this long before aiohttp cancels them (its
# default, 60 s, applied twice, held a SIGTERM for minutes behind a hung engine).
_HANDLER_SHUTDOWN_S = 5.0
_T = TypeVar("_T")

# Called once the server listens; may return an async cleanup run at shutdown (before the
# engine stops). Workers use it to start their proxy registration heartbeat.
StartupHook = Callable[[AsyncEngineClient, "ServerOptions"],
                       Awaitable[Callable[[], Awaitable[None]] | None]]



@dataclass(frozen=True)
class ServerOptions:
    """The API process's settings of one server (the engine's are in ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    enable_admin_endpoints: bool = False
    client_max_size: int = 32 << 20
    log_stats_interval_s: float = 10.0
    # On SIGTERM/SIGINT (--shutdown-timeout): refuse new generation requests (503), let those
    # in flight finish and the KV they hold be released for this long, then end the rest with
    # an error (streams get an error event and [DONE]). Below `pdserve launch`'s
    # --stop-timeout (15 s) and a pod's terminationGracePeriodSeconds, so a supervisor's
    # stop drains before it kills.
    shutdown_drain_s: float = 10.0
    # How long the engine process may take to start (load the model) before the server
    # gives up and exits 1 (`--engine-startup-timeout`, VLLM_ENGINE_READY_TIMEOUT_S).
    engine_startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    # Seconds a client may take to send its whole request body (408 beyond, --body-timeout):
    # a stalled upload would otherwise hold a handler, its connection and up to
    # client_max_size of buffer for good.
    body_timeout_s: float = 30.0
    # Seconds a connection may sit idle, or with its request headers unfinished, before it is
    # closed: aiohttp's AppRunner default is an hour (web.run_app's is 75 s).
    keepalive_timeout_s: float = 75.0
    # Seconds a client may take to send a request line and headers (--header-timeout): 408
    # and the connection closed beyond, so headers trickled a byte at a time hold nothing.
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Seconds one write of a streamed answer may wait for the client to take it (its TCP
    # window full: it stopped reading) before its connection and engine requests are aborted
    # (--write-timeout); unbounded, such a client held them, and their KV blocks, for good.
    write_timeout_s: float = 60.0
    # --enable-auto-tool-choice and --tool-call-parser.
    tool_calls: ToolCallOptions = field(default_factory=ToolCallOptions)
    # --chat-template's text, in place of the tokenizer's template (None: the tokenizer's).
    chat_template: str | None = None
    # Seconds after startup the grammar engine is imported, unless a constrained request
    # needs it sooner (``engine_core/grammar/prefetch.py``); inf: only then
    # (--grammar-import-delay).
    grammar_import_delay_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("write_timeout_s", "header_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.grammar_import_delay_s >= 0:
            raise ConfigError("grammar_import_delay_s must be >= 0 seconds or inf, got "
                              f"{self.grammar_import_delay_s}")


OPTIONS_KEY = web.AppKey("options", ServerOptions)
READINESS_KEY = web.AppKey("readiness", Readiness)
JSON_PARSER_KEY = web.AppKey("json_parser", JsonParser)


# The admin routes (``--enable-admin-endpoints``): they need the API key always (api_key.py).
ADMIN_ROUTES = ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping")


def app_runner(app: web.Application, options: ServerOptions) -> web.AppRunner:
    """The runner of a server's app: handlers cancelled with their connection, no access log,
    connections idle for ``keepalive_timeout_s`` closed, request heads bounded by
    ``header_timeout_s`` and parser errors in JSON (``http_runner``)."""
    return EdgeAppRunner(app, header_timeout_s=options.header_timeout_s,
                         handler_cancellation=True, access_log=None,
                         shutdown_timeout=_HANDLER_SHUTDOWN_S,
                         keepalive_timeout=options.keepalive_timeout_s)


async def _read_json(request: web.Request, options: ServerOptions) -> dict[str, Any]:
    """The body as JSON, within the server's size and time bounds (``request_body``)."""
    request[REQUEST_ID_KEY] = request_id_of(request)
    return await read_json_body(request, options.client_max_size, options.body_timeout_s,
                                request.app[JSON_PARSER_KEY])


class _Routes:
    """Request handlers bound to one ``OpenAIServing``."""

    def __init__(self, serving: OpenAIServing, options: ServerOptions, model_path: str,
                 readiness: Readiness | None = None) -> None:
        self.serving = serving
        self.options = options
        self.model_path = model_path
        self.readiness = readiness or Readiness()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.readiness.admit():
            body = await _read_json(request, self.options)
            return await self.serving.completions(request, body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.readiness.admit():
            body = await _read_json(request, self.options)
            return await self.serving.chat(request, body)

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
             "root": self.model_path, "parent": None,
             "max_model_len": self.serving.tokenizer.max_model_len}
            for name in self.serving.model_names]})

    async def health(self, request: web.Request) -> web.Response:
        """200 when the engine core answers, or is alive and busy with a long operation (a
        sleep or wake-up: a liveness probe must not restart a worker mid-reload); 503 when it
        is gone or does not answer within ``HEALTH_TIMEOUT_S`` (a hung engine: load
        balancers take it out of rotation)."""
        client = self.serving.client
        if not client.is_alive:
            raise EngineDeadError("engine core is not running")
        if client.long_operation is None:
            await client.call("check_health", timeout_s=HEALTH_TIMEOUT_S)
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """``GET /ready`` (readiness; ``/health`` is liveness): 200 while the server takes new
        requests, else 503 naming what it waits for (its proxy registration, the drain)."""
        waiting_for = self.readiness.waiting_for()
        return web.json_response({"ready": not waiting_for, "waiting_for": waiting_for},
                                 status=503 if waiting_for else 200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": package_version()})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _read_json(request, self.options)
        model, prompt, is_chat, add_special = protocol.parse_tokenize_request(body)
        self.serving.check_model(model)
        tokenizer = self.serving.tokenizer
        if is_chat:
            ids = await tokenizer.call(tokenizer.encode_chat, prompt,
                                       body.get("add_generation_prompt") is not False)
        else:
            ids = await tokenizer.call(tokenizer.encode, prompt, add_special)
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": tokenizer.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _read_json(request, self.options)
        model, tokens = protocol.parse_detokenize_request(body)
        self.serving.check_model(model)
        tokenizer = self.serving.tokenizer
        return web.json_response({"prompt": await tokenizer.call(tokenizer.decode, tokens)})

    async def metrics(self, request: web.Request) -> web.Response:
        client = self.serving.client
        with contextlib.suppress(Exception):
            await client.refresh_stats(timeout_s=METRICS_STATS_TIMEOUT_S)
        self.serving.metrics.engine_stats = client.latest_stats
        return web.Response(body=self.serving.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def sleep(self, request: web.Request) -> web.Response:
        """``POST /sleep?level=1|2`` (vLLM's): free the weights and KV cache while idle."""
        raw = request.query.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            raise InvalidRequestError(f"level must be 1 or 2, got {raw!r}", "level") from None
        await self.serving.client.call("sleep", timeout_s=600.0, level=level)
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        """``POST /wake_up[?tags=weights&tags=kv_cache]`` (vLLM's): weights, KV cache and
        graphs back; with ``tags`` only those (the engine serves once both are back)."""
        tags = request.query.getall("tags", None)
        await self.serving.client.call("wake_up", timeout_s=600.0,
                                       **({} if tags is None else {"tags": list(tags)}))
        return web.Response(status=200)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(await self.serving.client.call("is_sleeping"))})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = await self.serving.client.call("reset_prefix_cache")
        return web.json_response({"success": bool(ok)}, status=200 if ok else 409)


async def _log_stats_periodically(client: AsyncEngineClient, interval_s: float) -> None:
    """vLLM-style throughput / KV-usage lines while the engine is busy."""
    last = None
    last_time = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        stats, now = client.latest_stats, time.monotonic()
        if stats is None or not client.is_alive:
            continue
        if last is not None and (stats.num_running or stats.num_waiting
                                 or stats != last):
            elapsed = max(now - last_time, 1e-6)
            prompt_tps = (stats.prompt_tokens_total - last.prompt_tokens_total) / elapsed
            gen_tps = (stats.generation_tokens_total - last.generation_tokens_total) / elapsed
            queries = stats.prefix_cache_queries - last.prefix_cache_queries
            hits = stats.prefix_cache_hits - last.prefix_cache_hits
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%", prompt_tps, gen_tps, stats.num_running,
                stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hits / max(queries, 1))
        last, last_time = stats, now


def build_app(client: AsyncEngineClient, tokenizer: TokenizerService, config: EngineConfig,
              options: ServerOptions,
              generation: GenerationDefaults = protocol.NO_DEFAULTS,
              readiness: Readiness | None = None,
              grammar: GrammarEngineImport | None = None) -> web.Application:
    """The aiohttp application over a started engine client; ``generation``: the
    generation config's request defaults; ``readiness``: what ``/ready`` reports;
    ``grammar``: the grammar engine's import (one made on first need when None)."""
    names = [config.model.name]
    cache = config.cache
    metrics = ServerMetrics(names[0], cache_info={
        "block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "prefix_caching_hash_algo": cache.prefix_caching_hash_algo,
        "kv_offloading_size": str(cache.kv_offloading_size)})
    serving = OpenAIServing(client, tokenizer, names, metrics,
                            write_timeout_s=options.write_timeout_s, generation=generation,
                            tool_calls=options.tool_calls, grammar=grammar)
    app = web.Application(client_max_size=options.client_max_size,
                          middlewares=[error_middleware,
                                       api_key_middleware(options.api_key, ADMIN_ROUTES)])
    app[SERVING_KEY] = serving
    app[OPTIONS_KEY] = options
    app[READINESS_KEY] = readiness = readiness or Readiness()
    app[JSON_PARSER_KEY] = json_parser = JsonParser()
    routes = _Routes(serving, options, config.model.model, readiness)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/health", routes.health)
    # SageMaker's health check (vLLM serves it): /health's meaning, by GET or POST.
    app.router.add_get("/ping", routes.health)
    app.router.add_post("/ping", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/version", routes.version)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/metrics", routes.metrics)
    if options.enable_admin_endpoints:
        app.router.add_post("/reset_prefix_cache", routes.reset_prefix_cache)
        app.router.add_post("/sleep", routes.sleep)
        app.router.add_post("/wake_up", routes.wake_up)
        app.router.add_get("/is_sleeping", routes.is_sleeping)

    async def stats_logger(app: web.Application) -> Any:
        task = None
        if options.log_stats_interval_s > 0:
            task = asyncio.create_task(_log_stats_periodically(client,
                                                               options.log_stats_interval_s))
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(stats_logger)

    async def loop_watch(app: web.Application) -> Any:
        watch = LoopWatch(f"server :{options.port}", on_stall=metrics.observe_loop_stall)
        await watch.start()
        yield
        await watch.stop()

    app.cleanup_ctx.append(loop_watch)

    async def tokenizer_thread(app: web.Application) -> Any:
        yield
        tokenizer.close()
        await json_parser.close()

    app.cleanup_ctx.append(tokenizer_thread)
    return app


async def start_engine_and_app(config: EngineConfig, options: ServerOptions,
                               engine_factory: EngineFactory | None = None,
                               readiness: Readiness | None = None,
                               freeze_heap: bool = False,
                               ) -> tuple[AsyncEngineClient, web.Application]:
    """Start the engine process, load the tokenizer, build the app; logs each stage. With
    ``freeze_heap`` (a server process: ``serve``), the grammar engine's import ends with
    ``gc.freeze()`` as startup does."""
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    # The HF tokenizer loads on a thread while the engine process starts: the API process
    # would otherwise sit idle, then spend about a second on it before it can listen.
    preload = preload_hf_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
    client = await AsyncEngineClient.start(
        config, engine_factory, startup_timeout_s=options.engine_startup_timeout_s)
    info = client.info
    logger.info("Engine core started in %.2fs: %d KV blocks of %d tokens, max_model_len %d",
                time.monotonic() - started, info.num_total_blocks, config.cache.block_size,
                info.max_model_len)
    try:
        stage = time.monotonic()
        hf_tokenizer = None
        if preload is not None:
            # Awaited even when unused: transformers' lazy module must not be imported from
            # two threads at once. A failed preload is loaded again below, which reports it.
            with contextlib.suppress(Exception):
                hf_tokenizer = await asyncio.wrap_future(preload)
            if info.tokenizer_path != config.model.tokenizer_path:
                hf_tokenizer = None
        tokenizer = await loop.run_in_executor(
            None, lambda: TokenizerService.load(
                info.tokenizer_path, info.max_model_len, info.vocab_size,
                config.model.trust_remote_code,
                kv_capacity=info.num_total_blocks * config.cache.block_size,
                chat_template=options.chat_template, hf_tokenizer=hf_tokenizer))
        logger.info("Tokenizer loaded in %.2fs from %s", time.monotonic() - stage,
                    info.tokenizer_path)
        # After the tokenizer: xgrammar imports names from transformers, whose lazy module
        # cannot be imported from two threads at once.
        grammar = GrammarEngineImport(freeze_heap)
        grammar.start_after(options.grammar_import_delay_s)
        generation = load_generation_defaults(config.model, tokenizer.eos_token_id)
        return client, build_app(client, tokenizer, config, options, generation, readiness,
                                 grammar)
    except BaseException:
        await client.shutdown()
        raise


async def _unless_stopped(startup: Awaitable[_T], stop: asyncio.Event) -> _T | None:
    """``startup``'s result, or None when ``stop`` is set first.

    Startup (engine spawn, model load) can take minutes; a SIGTERM then cancels it, which
    kills the engine process. Before, SIGTERM's default action killed only this process,
    and the engine went on loading (holding the GPU) until it noticed its parent was gone.
    """
    task = asyncio.ensure_future(startup)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def serve(config: EngineConfig, options: ServerOptions,
                engine_factory: EngineFactory | None = None,
                on_startup: Sequence[StartupHook] = (),
                readiness: Readiness | None = None) -> None:
    """Run the server until SIGINT/SIGTERM, or until the engine dies: then, once shut down,
    raise ``EngineDeadError`` so the process exits non-zero (a supervisor restarts on that).

    Shutdown order: draining (``/ready`` 503, new generation requests 503), the startup
    hooks' cleanups (a worker deregisters from its proxy), the requests in flight finish and
    their KV is released (``shutdown_drain_s`` at most), then the listener closes and the
    engine stops. The listener stays open while draining, so liveness probes still reach
    the server.
    """
    started = time.monotonic()
    readiness = readiness or Readiness()
    check_port_free(options.host, options.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ready = await _unless_stopped(
        start_engine_and_app(config, options, engine_factory, readiness, freeze_heap=True),
        stop)
    if ready is None:
        logger.info("Stopped during startup")
        return
    # What startup made (modules, the tokenizer, later the grammar engine's torch) lives as
    # long as the process: in the permanent generation the collector no longer walks it in
    # each full collection while serving, nor in the one at exit (about a second a stop).
    gc.freeze()
    client, app = ready
    runner = app_runner(app, options)
    site: web.TCPSite | None = None
    cleanups: list[Callable[[], Awaitable[None]]] = []
    engine_died = False
    try:
        stage = time.monotonic()
        await runner.setup()
        site = web.TCPSite(runner, options.host, options.port)
        await site.start()
        logger.info("HTTP server listening on http://%s:%d in %.2fs (total startup %.2fs)",
                    options.host, options.port, time.monotonic() - stage,
                    time.monotonic() - started)
        for hook in on_startup:
            cleanup = await hook(client, options)
            if cleanup is not None:
                cleanups.append(cleanup)
        while not stop.is_set() and client.is_alive:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        if not client.is_alive:
            engine_died = True
            logger.error("engine core died; shutting down the server")
    finally:
        logger.info("Shutting down")
        readiness.draining = True
        for cleanup in reversed(cleanups):
            try:
                await cleanup()
            except Exception:
                logger.exception("shutdown hook failed")
        await drain(client, readiness, options.shutdown_drain_s if client.is_alive else 0.0)
        if site is not None:
            await site.stop()
        await runner.cleanup()
        await client.shutdown()
    if engine_died:
        raise EngineDeadError("the engine core process died while serving")


def check_port_free(host: str | None, port: int) -> None:
    """Raise ConfigError when the HTTP port cannot be bound, before the engine starts: the
    server binds only once the model is loaded, and a taken port must not show only then
    (minutes on a GPU). A probe, not a reservation: a port taken in between still fails
    late, but the usual mistake is caught at once."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} cannot be resolved: {exc}") from None
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # e.g. no IPv6 on this host: the server will not bind it either
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise ConfigError(f"cannot serve HTTP on port {port} of "
                                  f"{host or 'every interface'}: {exc.strerror}") from None


def run_server(config: EngineConfig, options: ServerOptions,
               engine_factory: EngineFactory | None = None,
               on_startup: Sequence[StartupHook] = (),
               readiness: Readiness | None = None) -> None:
    """Blocking entry point; uses uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    # Outside the except clause: every traceback the server logs would be chained to the
    # ImportError otherwise.
    (asyncio.run if uvloop is None else uvloop.run)(
        serve(config, options, engine_factory, on_startup, readiness))
