"""The engine-core process: an ``EngineCore`` driven by messages on two ZMQ sockets.

The API process binds a PUSH socket (inputs) and a PULL socket (outputs); this process
connects a PULL to the first and a PUSH to the second. It busy-steps while a step would
compute, steps at a 1 ms cadence while only KV transfers are pending (waiting on the input
socket in between, so the connector's threads get the GIL), and blocks on its input socket
(100 ms poll) when idle. Malformed messages are
logged, counted and dropped. Stats ride along with outputs at most every
``stats_interval_s`` and once more whenever the engine goes idle.

Startup handshake: once the engine is built, the process sends ``UtilityResult`` with
``call_id == READY_CALL_ID`` whose result describes the engine (``engine_info``); if
building fails it sends ``ok=False`` with the error and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from engine_core.config import EngineConfig
from engine_core.errors import EngineSleepingError, InvalidRequestError, MessageDecodeError
from engine_core.messages import (
    ENGINE_INPUT_CODEC,
    ENGINE_OUTPUT_CODEC,
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    UtilityCall,
    UtilityResult,
)

if TYPE_CHECKING:
    from engine_core.engine_core import EngineCore

logger = logging.getLogger(__name__)

READY_CALL_ID = 0
UTILITY_METHODS = ("reset_prefix_cache", "get_stats", "check_health", "shutdown", "sleep",
                   "wake_up", "is_sleeping")
_IDLE_POLL_MS = 100
# Only remote transfers pending (requests parked for their KV, finished prefills held until
# sent): wait this long on the input socket instead of spinning. A spinning loop keeps the
# GIL, and the connector's control and sender threads then wait for it in switch-interval
# slices (5 ms by default), which delays every header, receive post and send. A transfer that
# lands or fails rings the connector's doorbell, which ends the wait at once; this timeout
# only paces deadline checks.
_TRANSFER_POLL_MS = 1
# GIL switch interval of an engine with a KV connector: its sender/control threads issue
# NCCL calls and post receives while the main thread runs the model; 0.5 ms bounds how long
# they wait for the GIL (Python's default is 5 ms).
CONNECTOR_SWITCH_INTERVAL_S = 0.0005

EngineFactory = Callable[[EngineConfig], "EngineCore"]


def default_engine_factory(config: EngineConfig) -> EngineCore:
    """A colocated engine: ``EngineCore(config)`` with the null connector."""
    from engine_core.engine_core import EngineCore

    return EngineCore(config)


def engine_info(engine: EngineCore) -> dict[str, Any]:
    """What the API process needs to know about the engine it talks to."""
    stats = engine.get_stats()
    kv_ranks = engine.peer_ranks()
    return {
        "tokenizer_path": str(engine.tokenizer_path),
        "max_model_len": int(engine.max_model_len),
        "eos_token_ids": [int(t) for t in engine.eos_token_ids],
        "vocab_size": int(engine.vocab_size),
        "num_total_blocks": int(stats.num_total_blocks),
        "num_free_blocks": int(stats.num_free_blocks),
        "kv_ranks": None if kv_ranks is None else kv_ranks.to_wire(),
    }


class EngineCoreProc:
    """The loop around one engine: read inputs, step, push outputs."""

    def __init__(self, engine: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 parent_pid: int | None = None, stats_interval_s: float = 1.0) -> None:
        self._engine = engine
        self._input = input_socket
        self._output = output_socket
        self._parent_pid = parent_pid
        self._stats_interval_s = stats_interval_s
        self._last_stats_time = 0.0
        self._was_busy = False
        self.num_rejected_messages = 0
        self.running = True
        # The input socket and, with a connector, its doorbell: a landed transfer wakes the
        # loop at once instead of at the next transfer poll.
        self._poller = zmq.Poller()
        self._poller.register(input_socket, zmq.POLLIN)
        self._doorbell = engine.doorbell()
        if self._doorbell is not None:
            self._poller.register(self._doorbell.fileno(), zmq.POLLIN)

    def stop(self) -> None:
        """Ask the loop to exit after the current iteration (signal-safe)."""
        self.running = False

    def _send(self, message: Any) -> None:
        self._output.send(ENGINE_OUTPUT_CODEC.encode(message), copy=False)

    def _stats(self) -> Any:
        stats = self._engine.get_stats()
        return dataclasses.replace(stats, rejected_messages=self.num_rejected_messages)

    def _send_state(self) -> None:
        """Stats now, ahead of the call's result: the API process (its heartbeat to the
        proxy, its /metrics) sees the engine asleep or awake before the caller does."""
        self._last_stats_time = time.monotonic()
        self._send(EngineOutputs(outputs=[], stats=self._stats()))

    def _parent_alive(self) -> bool:
        return self._parent_pid is None or os.getppid() == self._parent_pid

    def _handle(self, payload: bytes) -> None:
        try:
            message = ENGINE_INPUT_CODEC.decode(payload)
        except MessageDecodeError as exc:
            self.num_rejected_messages += 1
            logger.warning("dropped malformed engine input (%d so far): %s",
                           self.num_rejected_messages, exc)
            return
        if isinstance(message, AddRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            self._engine.abort_requests(list(message.request_ids))
        elif isinstance(message, UtilityCall):
            self._utility(message)

    def _add_request(self, message: AddRequest) -> None:
        try:
            self._engine.add_request(message)
        except Exception as exc:  # the request fails, the engine lives on
            if isinstance(exc, EngineSleepingError):  # a state the client is told of (503)
                logger.info("request %s refused: %s", message.request_id, exc)
            elif not isinstance(exc, InvalidRequestError):
                logger.exception("request %s failed to start", message.request_id)
            error = f"{type(exc).__name__}: {exc}"
            self._send(EngineOutputs(outputs=[EngineOutput(
                request_id=message.request_id, new_token_ids=[],
                num_prompt_tokens=len(message.prompt_token_ids), num_cached_tokens=0,
                finish_reason="error", error=error,
                error_param=exc.param if isinstance(exc, InvalidRequestError) else None)]))

    def _utility(self, call: UtilityCall) -> None:
        try:
            if call.method == "reset_prefix_cache":
                result: Any = bool(self._engine.reset_prefix_cache())
            elif call.method == "get_stats":
                result = dataclasses.asdict(self._stats())
            elif call.method == "check_health":
                result = True
            elif call.method == "sleep":
                level = call.args.get("level", 1)
                if not isinstance(level, int) or isinstance(level, bool):
                    raise InvalidRequestError(f"sleep level must be an integer, got {level!r}",
                                              "level")
                self._engine.sleep(level)
                self._send_state()
                result = True
            elif call.method == "wake_up":
                tags = call.args.get("tags")
                if tags is not None and not (isinstance(tags, list)
                                             and all(isinstance(t, str) for t in tags)):
                    raise InvalidRequestError("wake_up tags must be a list of names", "tags")
                self._engine.wake_up(tags)
                self._send_state()
                result = True
            elif call.method == "is_sleeping":
                result = self._engine.sleep_level > 0
            elif call.method == "shutdown":
                result = True
                self.stop()
            else:
                raise ValueError(f"unknown utility method {call.method!r}; "
                                 f"expected one of {UTILITY_METHODS}")
            self._send(UtilityResult(call_id=call.call_id, ok=True, result=result))
        except Exception as exc:
            self._send(UtilityResult(call_id=call.call_id, ok=False,
                                     error=f"{type(exc).__name__}: {exc}"))

    def _drain_inputs(self, timeout_ms: int) -> None:
        """Handle every queued input; wait up to ``timeout_ms`` for the first one (or for
        the connector's doorbell)."""
        if timeout_ms:
            ready = dict(self._poller.poll(timeout_ms))
            if self._doorbell is not None and self._doorbell.fileno() in ready:
                self._doorbell.drain()
            if self._input not in ready:
                return
        while True:
            try:
                payload = self._input.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(payload)

    def run(self) -> None:
        """Serve until stopped, the parent dies, or a step raises (fatal)."""
        while self.running:
            self._drain_inputs(poll_timeout_ms(self._engine))
            if not self._parent_alive():
                logger.warning("parent process is gone; engine core exits")
                return
            if not self.running:
                return
            if self._engine.has_work():
                outputs = self._engine.step()
                now = time.monotonic()
                stats = None
                if now - self._last_stats_time >= self._stats_interval_s:
                    stats, self._last_stats_time = self._stats(), now
                if outputs or stats is not None:
                    self._send(EngineOutputs(outputs=outputs, stats=stats))
                self._was_busy = True
            elif self._engine.has_transfer_state():
                # No request left, but transfer state is (an aborted request's load until
                # its deadline): an empty step at the idle poll cadence expires and frees it.
                outputs = self._engine.step()
                if outputs:
                    self._send(EngineOutputs(outputs=outputs))
                self._was_busy = True
            elif self._was_busy:
                # Going idle: let the API process see the final (all blocks free) state.
                self._was_busy = False
                self._last_stats_time = time.monotonic()
                self._send(EngineOutputs(outputs=[], stats=self._stats()))


def poll_timeout_ms(engine: EngineCore) -> int:
    """How long the loop may wait for input before its next step: not at all while a step
    would compute; ``_TRANSFER_POLL_MS`` while only transfers are pending, or while the
    last step could schedule nothing (the queue's head waits for blocks that parked or
    held requests keep until their transfers end: spinning there would keep the GIL from
    the very connector threads that free them); ``_IDLE_POLL_MS`` with no work."""
    if not engine.has_work():
        return _IDLE_POLL_MS
    if engine.has_runnable() and not engine.stalled:
        return 0
    return _TRANSFER_POLL_MS


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that spawned it exits.

    Why: the engine also checks its parent between steps, but a step or a startup that does
    not return (a hung NCCL call, a model loading for minutes, a wake-up reload) outlived a
    SIGKILLed API process, holding its GPU memory and ports. Checked again afterwards: a
    parent already gone before the call would never deliver the signal."""
    if sys.platform != "linux" or parent_pid is None:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the between-steps check remains
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    engine_factory: EngineFactory | None = None, parent_pid: int | None = None,
                    log_level: int = logging.INFO, stats_interval_s: float = 1.0) -> None:
    """Entry point of the spawned engine-core process."""
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and stops us
    die_with_parent(parent_pid)
    if config.kv_transfer is not None:
        sys.setswitchinterval(CONNECTOR_SWITCH_INTERVAL_S)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.LINGER, 0)
    # No larger message can decode: one is refused at its frame header, never buffered.
    input_socket.setsockopt(zmq.MAXMSGSIZE, ENGINE_INPUT_CODEC.max_bytes)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.connect(output_address)
    engine = None
    try:
        started = time.monotonic()
        try:
            engine = (engine_factory or default_engine_factory)(config)
            info = engine_info(engine)
        except Exception as exc:
            logger.exception("engine core failed to start")
            output_socket.send(ENGINE_OUTPUT_CODEC.encode(UtilityResult(
                call_id=READY_CALL_ID, ok=False, error=f"{type(exc).__name__}: {exc}",
                result=traceback.format_exc())))
            return
        logger.info("engine core ready in %.2fs (%d KV blocks)",
                    time.monotonic() - started, info["num_total_blocks"])
        proc = EngineCoreProc(engine, input_socket, output_socket, parent_pid, stats_interval_s)
        signal.signal(signal.SIGTERM, lambda *_: proc.stop())
        output_socket.send(ENGINE_OUTPUT_CODEC.encode(
            UtilityResult(call_id=READY_CALL_ID, ok=True, result=info)))
        proc.run()
        logger.info("engine core stopping")
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
        input_socket.close()
        output_socket.close()
        context.term()
