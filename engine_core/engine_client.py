"""``AsyncEngineClient``: the API process's handle on its engine-core child process.

It spawns the engine (``multiprocessing`` "spawn" context, a picklable ``engine_factory``),
binds the two ZMQ sockets, waits for the ready handshake, then routes engine outputs to
per-request queues. A dead engine process fails every in-flight request and utility call
with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from engine_core import errors
from engine_core.config import EngineConfig
from engine_core.engine_process import READY_CALL_ID, EngineFactory, run_engine_core
from engine_core.errors import (
    ConfigError,
    EngineDeadError,
    EngineUnresponsiveError,
    InvalidRequestError,
    MessageDecodeError,
    PdserveError,
)
from engine_core.ipc_sockets import make_socket_dir
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.messages import (
    ENGINE_INPUT_CODEC,
    ENGINE_OUTPUT_CODEC,
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    EngineStats,
    UtilityCall,
    UtilityResult,
)
from engine_core.parallel.kv_layout import PeerRanks
from engine_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the engine reported at startup."""

    tokenizer_path: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    num_total_blocks: int
    num_free_blocks: int
    kv_ranks: PeerRanks | None = None  # the connector's layout and rank addresses


def request_error(message: str | None, param: str | None = None) -> PdserveError:
    """Rebuild the exception an engine reported as ``"TypeName: message"`` (an invalid
    request with the parameter it names, ``param``, for the error body)."""
    text = message or "request failed in the engine"
    name, _, detail = text.partition(": ")
    klass = getattr(errors, name, None)
    if isinstance(klass, type) and issubclass(klass, InvalidRequestError) and detail:
        return klass(detail, param)
    if isinstance(klass, type) and issubclass(klass, PdserveError) and detail:
        return klass(detail)
    return PdserveError(text)


# Utility calls that may run for minutes (a level-2 wake-up reloads the weights): while one
# is in flight the engine answers nothing else, and /health reports it busy, not hung.
LONG_OPERATIONS = frozenset({"sleep", "wake_up"})
_REAP_TIMEOUT_S = 1.0
# How long the engine process may take to build (load the weights, size the KV cache,
# capture graphs) before start() gives up. vLLM's default; a large model on a slow disk
# needs more (`--engine-startup-timeout`, or vLLM's VLLM_ENGINE_READY_TIMEOUT_S), CI less.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_HINT = "--engine-startup-timeout SECONDS (or VLLM_ENGINE_READY_TIMEOUT_S)"

class AsyncEngineClient:
    """Talks to one engine-core process over ZMQ; use ``await AsyncEngineClient.start(...)``."""

    def __init__(self, process: Any, info: EngineInfo, input_socket: zmq.Socket,
                 output_socket: zmq.asyncio.Socket, contexts: tuple[zmq.Context, ...],
                 socket_dir: str | None) -> None:
        self._process = process
        self.info = info
        self._input = input_socket
        self._output = output_socket
        self._contexts = contexts
        self._socket_dir = socket_dir
        # By engine request id: the caller's id plus a per-call number, so that outputs still
        # on their way for an ended call (its last token, its abort) never reach a later call
        # that reuses the caller's id.
        self._queues: dict[str, asyncio.Queue[EngineOutput | BaseException]] = {}
        self._in_flight: set[str] = set()  # callers' ids
        self._generations = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(READY_CALL_ID + 1)
        self._long_calls: dict[int, str] = {}  # call id -> method, for LONG_OPERATIONS
        self._dead: EngineDeadError | None = None
        self._refusal: EngineDeadError | None = None  # set by fail_in_flight: no new generate
        self._closed = False
        self.latest_stats: EngineStats | None = None
        self._sleep_listeners: list[Callable[[], object]] = []
        self.num_rejected_messages = 0
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_outputs())
        loop.add_reader(process.sentinel, self._on_process_exit)

    @classmethod
    async def start(cls, config: EngineConfig, engine_factory: EngineFactory | None = None, *,
                    input_address: str | None = None, output_address: str | None = None,
                    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                    log_level: int | None = None,
                    stats_interval_s: float = 1.0) -> AsyncEngineClient:
        """Spawn the engine process, wait for its handshake (up to ``startup_timeout_s``),
        and return a connected client."""
        if not 0 < startup_timeout_s < float("inf"):
            raise ConfigError(f"engine startup timeout must be > 0 seconds, got "
                              f"{startup_timeout_s}")
        socket_dir = None
        if input_address is None or output_address is None:
            socket_dir = make_socket_dir()
            input_address = input_address or f"ipc://{socket_dir}/input"
            output_address = output_address or f"ipc://{socket_dir}/output"
        sync_context = zmq.Context()
        async_context = zmq.asyncio.Context()
        input_socket = sync_context.socket(zmq.PUSH)
        input_socket.setsockopt(zmq.LINGER, 0)
        input_socket.setsockopt(zmq.SNDHWM, 0)
        input_socket.bind(input_address)
        output_socket = async_context.socket(zmq.PULL)
        output_socket.setsockopt(zmq.LINGER, 0)
        output_socket.setsockopt(zmq.RCVHWM, 0)
        # No larger message can decode: one is refused at its frame header, never buffered.
        output_socket.setsockopt(zmq.MAXMSGSIZE, ENGINE_OUTPUT_CODEC.max_bytes)
        output_socket.bind(output_address)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pdserve-engine-core", daemon=True,
            args=(config, input_address, output_address, engine_factory, os.getpid(), level,
                  stats_interval_s))
        process.start()

        def cleanup() -> None:
            if process.is_alive():
                process.kill()
            process.join(5)
            input_socket.close()
            output_socket.close()
            sync_context.term()
            async_context.term()
            if socket_dir:
                shutil.rmtree(socket_dir, ignore_errors=True)

        deadline = time.monotonic() + startup_timeout_s
        try:
            while True:
                if await output_socket.poll(200):
                    message = ENGINE_OUTPUT_CODEC.decode(await output_socket.recv())
                    if isinstance(message, UtilityResult) and message.call_id == READY_CALL_ID:
                        break
                    continue
                if not process.is_alive():
                    raise EngineDeadError(
                        f"engine process exited during startup (code {process.exitcode})")
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"engine did not start within {startup_timeout_s:g} s; a model that "
                        f"takes longer to load needs a larger {STARTUP_TIMEOUT_HINT}")
        except BaseException:
            cleanup()
            raise
        if not message.ok:
            cleanup()
            raise EngineDeadError(f"engine failed to start: {message.error}")
        # A bound PUSH has no pipe until the engine's connect completes (tcp can lag the ready
        # message). Wait until it is writable, so a later EAGAIN can only mean a dead engine.
        while not input_socket.poll(50, zmq.POLLOUT):
            if not process.is_alive() or time.monotonic() > deadline:
                cleanup()
                raise EngineDeadError("engine input socket never connected")
            await asyncio.sleep(0.01)
        data = message.result
        info = EngineInfo(tokenizer_path=data["tokenizer_path"],
                          max_model_len=data["max_model_len"],
                          eos_token_ids=tuple(data["eos_token_ids"]),
                          vocab_size=data["vocab_size"],
                          num_total_blocks=data["num_total_blocks"],
                          num_free_blocks=data["num_free_blocks"],
                          kv_ranks=(None if data.get("kv_ranks") is None
                                    else PeerRanks.from_wire(data["kv_ranks"])))
        return cls(process, info, input_socket, output_socket,
                   (sync_context, async_context), socket_dir)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _send(self, message: Any) -> None:
        """Queue a message for the engine; never blocks (unbounded send queue)."""
        if self._dead is not None:
            raise self._dead
        try:
            payload = ENGINE_INPUT_CODEC.encode(message)
        except (ValueError, TypeError, OverflowError) as exc:  # msgpack cannot carry a value
            raise InvalidRequestError(f"the request cannot be sent to the engine: {exc}",
                                             None) from None
        if len(payload) > ENGINE_INPUT_CODEC.max_bytes:
            # The engine would drop it as malformed without a word, and the request would
            # wait for its outputs forever.
            raise InvalidRequestError(
                f"the request is {len(payload)} bytes encoded, over the engine's limit of "
                f"{ENGINE_INPUT_CODEC.max_bytes}", None)
        try:
            self._input.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            # After start() the engine is connected; a PUSH with no peer means it is gone.
            error = EngineDeadError("the engine process is not accepting input (it exited)")
            self._fail_all(error)
            raise error from None

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _on_process_exit(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._process.sentinel)
        # The sentinel turns readable when the child closes its descriptors, which can be a
        # moment before it can be reaped: join(0) then read no exit code (an OOM kill's -9
        # reported as None).
        self._process.join(_REAP_TIMEOUT_S)
        if not self._closed:
            logger.error("engine core process died (exit code %s); failing %d requests",
                         self._process.exitcode, len(self._queues))
        self._fail_all(EngineDeadError(
            f"engine core process exited (code {self._process.exitcode})"))

    def add_sleep_listener(self, listener: Callable[[], object]) -> None:
        """Call ``listener()`` whenever the engine falls asleep or wakes up, once its stats
        say so (``latest_stats``: the engine sends them ahead of the call's result)."""
        self._sleep_listeners.append(listener)

    def _take_stats(self, stats: EngineStats) -> None:
        previous, self.latest_stats = self.latest_stats, stats
        if previous is not None and (previous.sleep_level > 0) != (stats.sleep_level > 0):
            for listener in self._sleep_listeners:
                listener()

    async def _read_outputs(self) -> None:
        while True:
            payload = await self._output.recv()
            try:
                message = ENGINE_OUTPUT_CODEC.decode(payload)
            except MessageDecodeError as exc:
                self.num_rejected_messages += 1
                logger.warning("dropped malformed engine output: %s", exc)
                continue
            if isinstance(message, EngineOutputs):
                if message.stats is not None:
                    self._take_stats(message.stats)
                for output in message.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                # A message already waiting is received without suspending: behind by many
                # steps, this loop would dispatch them all before any stream wrote a byte
                # (H100 1P1D at 20 req/s: the decode worker's loop held 1.2-2.3 s here).
                await asyncio.sleep(0)
            elif isinstance(message, UtilityResult):
                future = self._calls.pop(message.call_id, None)
                if future is None or future.done():
                    continue
                if message.ok:
                    future.set_result(message.result)
                else:
                    # The engine's error type travels as its name (400 for a bad argument).
                    future.set_exception(request_error(message.error or "utility call failed"))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling_params: SamplingParams,
                       kv_transfer_params: KVTransferParams | None = None,
                       generated_token_ids: Sequence[int] = (),
                       ) -> AsyncIterator[EngineOutput]:
        """Stream the engine's outputs for one request; abort it if the caller stops early.

        ``generated_token_ids``: output tokens sampled elsewhere that the request continues
        after (see ``AddRequest``)."""
        if self._dead is not None:
            raise self._dead
        if self._refusal is not None:
            raise self._refusal
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        engine_id = f"{request_id}#{next(self._generations)}"
        queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._queues[engine_id] = queue
        self._in_flight.add(request_id)
        finished = False
        try:
            self._send(AddRequest(request_id=engine_id, prompt_token_ids=list(prompt_token_ids),
                                  sampling_params=sampling_params.to_dict(),
                                  arrival_time=time.monotonic(),
                                  kv_transfer_params=kv_transfer_params,
                                  generated_token_ids=list(generated_token_ids)))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason == "error":
                    finished = True
                    raise request_error(item.error, item.error_param)
                finished = item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(engine_id, None)
            self._in_flight.discard(request_id)
            if not finished and self._dead is None and not self._closed:
                with contextlib.suppress(EngineDeadError):
                    self._send(AbortRequests(request_ids=[engine_id]))

    async def call(self, method: str, timeout_s: float = 30.0, **args: Any) -> Any:
        """Run a utility method in the engine (reset_prefix_cache, get_stats, check_health);
        ``EngineUnresponsiveError`` (503) when it does not answer within ``timeout_s``."""
        if self._dead is not None:
            raise self._dead
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        if method in LONG_OPERATIONS:
            self._long_calls[call_id] = method
        try:
            self._send(UtilityCall(call_id=call_id, method=method, args=dict(args)))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on
            raise EngineUnresponsiveError(
                f"engine core did not answer {method} within {timeout_s:g} s") from None
        finally:
            self._calls.pop(call_id, None)
            self._long_calls.pop(call_id, None)

    @property
    def long_operation(self) -> str | None:
        """A ``LONG_OPERATIONS`` call in flight (the engine is busy with it, not hung)."""
        return next(iter(self._long_calls.values()), None)

    @property
    def num_in_flight(self) -> int:
        """Generate calls in flight."""
        return len(self._in_flight)

    def fail_in_flight(self, error: EngineDeadError) -> None:
        """End every generate call in flight with ``error`` and refuse later ones with it (a
        shutdown past its drain: each stream then ends with an error event, not a cut
        connection, and a request still being read or tokenized starts nothing)."""
        self._refusal = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def get_stats(self, timeout_s: float = 30.0) -> EngineStats:
        """A fresh stats snapshot from the engine."""
        return EngineStats(**await self.call("get_stats", timeout_s=timeout_s))

    async def refresh_stats(self, timeout_s: float = 30.0) -> EngineStats:
        """``get_stats``, kept as ``latest_stats`` (the sleep listeners told of a change)."""
        stats = await self.get_stats(timeout_s=timeout_s)
        self._take_stats(stats)
        return stats

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (gracefully, then by force) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None and self._process.is_alive():
            # NOBLOCK: an engine already tearing down (its sockets closed, the process still
            # alive) would never take it, and a blocking send froze the event loop for good.
            with contextlib.suppress(Exception):
                self._input.send(ENGINE_INPUT_CODEC.encode(
                    UtilityCall(call_id=next(self._call_ids), method="shutdown")),
                    flags=zmq.NOBLOCK)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, timeout_s)
        if self._process.is_alive():
            self._process.terminate()
            await loop.run_in_executor(None, self._process.join, 5)
        if self._process.is_alive():
            self._process.kill()
            await loop.run_in_executor(None, self._process.join, 5)
        with contextlib.suppress(Exception):
            loop.remove_reader(self._process.sentinel)
        self._fail_all(EngineDeadError("engine client shut down"))
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        self._input.close()
        self._output.close()
        for context in self._contexts:
            context.term()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
