"""Engine-core process and AsyncEngineClient over real ZMQ sockets, with a scripted engine.

The real-engine path is covered by tests/server; here a small fake engine (built in the
spawned child by a picklable factory) makes the protocol and failure paths fast to check.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from engine_core.config import EngineConfig, ModelConfig
from engine_core.engine_client import AsyncEngineClient
from engine_core.errors import EngineDeadError, InvalidRequestError
from engine_core.messages import ENGINE_INPUT_CODEC, AddRequest, EngineOutput, EngineStats
from engine_core.sampling_params import SamplingParams

TOTAL_BLOCKS = 64


class FakeEngine:
    """Emits token 7 once per step until max_tokens; holds 2 blocks per running request."""

    tokenizer_path = "/nonexistent"
    max_model_len = 32
    eos_token_ids = (0,)
    vocab_size = 100
    stalled = False  # every step it has work for computes

    def __init__(self, config: EngineConfig) -> None:
        self.requests: dict[str, list[int]] = {}  # id -> [generated, max_tokens, prompt_len]
        self.crash_on_step = config.model.model == "crash"

    def add_request(self, msg: AddRequest) -> None:
        if len(msg.prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError("prompt too long", "prompt")
        self.requests[msg.request_id] = [0, msg.sampling_params["max_tokens"],
                                         len(msg.prompt_token_ids)]

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self.requests)

    def has_runnable(self) -> bool:
        return bool(self.requests)

    def has_transfer_state(self) -> bool:
        return False

    def doorbell(self) -> None:
        return None

    def peer_ranks(self) -> None:
        return None

    def step(self) -> list[EngineOutput]:
        if self.crash_on_step:
            os._exit(3)
        time.sleep(0.002)
        outputs = []
        for rid, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(EngineOutput(rid, [7], state[2], 0,
                                        finish_reason="length" if done else None))
            if done:
                del self.requests[rid]
        return outputs

    def get_stats(self) -> EngineStats:
        used = 2 * len(self.requests)
        return EngineStats(num_running=len(self.requests), num_waiting=0,
                           num_waiting_for_remote_kv=0, kv_cache_usage=used / TOTAL_BLOCKS,
                           num_free_blocks=TOTAL_BLOCKS - used, num_total_blocks=TOTAL_BLOCKS,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           prompt_tokens_total=0, generation_tokens_total=0,
                           num_computed_prompt_tokens_total=0)

    def reset_prefix_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def fake_factory(config: EngineConfig) -> FakeEngine:
    return FakeEngine(config)


def failing_factory(config: EngineConfig) -> FakeEngine:
    raise RuntimeError("no such model")


def _config(name: str = "fake") -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=name))


async def _collect(client: AsyncEngineClient, rid: str, max_tokens: int) -> list[EngineOutput]:
    return [o async for o in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))]


async def test_generate_abort_utilities_and_shutdown():
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        assert client.info.num_total_blocks == TOTAL_BLOCKS and client.info.max_model_len == 32
        results = await asyncio.gather(*[_collect(client, f"r{i}", 5 + i) for i in range(20)])
        for i, outs in enumerate(results):
            assert sum(len(o.new_token_ids) for o in outs) == 5 + i
            assert outs[-1].finish_reason == "length"
        # Early exit aborts the request in the engine.
        agen = client.generate("early", [1], SamplingParams(max_tokens=10_000))
        await agen.__anext__()
        await agen.aclose()
        deadline = time.monotonic() + 5
        while (await client.get_stats()).num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (await client.get_stats()).num_free_blocks == TOTAL_BLOCKS
        with pytest.raises(InvalidRequestError, match="prompt too long"):
            async for _ in client.generate("long", list(range(40)), SamplingParams()):
                pass
        assert await client.call("check_health") is True
        assert await client.call("reset_prefix_cache") is True
        with pytest.raises(Exception, match="unknown utility"):
            await client.call("nope")
        # Malformed input is counted and dropped; the engine keeps serving.
        client._input.send(b"\x93garbage")
        client._input.send(b"\x00")
        stats = await client.get_stats()
        assert stats.rejected_messages == 2
        assert len(await _collect(client, "after", 3)) == 3
        assert client.latest_stats is not None
    finally:
        pid = client.pid
        await client.shutdown()
    assert not client.is_alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_an_id_reused_right_after_an_early_exit_gets_only_its_own_outputs():
    """A caller that stops reading (a stop string, a client gone) and reuses the request id
    at once: the old request's last tokens and its abort, still on their way, must not reach
    the new one (they were routed by the caller's id alone); a concurrent reuse is refused."""
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        for _ in range(5):
            old = client.generate("X", [1], SamplingParams(max_tokens=10_000))
            await old.__anext__()
            with pytest.raises(InvalidRequestError, match="already in flight"):
                await client.generate("X", [1], SamplingParams(max_tokens=3)).__anext__()
            await old.aclose()
            outs = await _collect(client, "X", 3)
            assert sum(len(o.new_token_ids) for o in outs) == 3
            assert [o.finish_reason for o in outs][-1] == "length"
            assert all(o.finish_reason is None for o in outs[:-1])
    finally:
        await client.shutdown()


async def test_tcp_addresses():
    ctx = zmq.Context()
    ports = []
    for _ in range(2):
        s = ctx.socket(zmq.PULL)
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        s.close()
    ctx.term()
    client = await AsyncEngineClient.start(
        _config(), fake_factory, input_address=f"tcp://127.0.0.1:{ports[0]}",
        output_address=f"tcp://127.0.0.1:{ports[1]}")
    try:
        assert len(await _collect(client, "t", 4)) == 4
    finally:
        await client.shutdown()


async def test_startup_failure_is_reported():
    with pytest.raises(EngineDeadError, match="no such model"):
        await AsyncEngineClient.start(_config(), failing_factory)


def _hanging_factory(config: EngineConfig) -> FakeEngine:
    time.sleep(60)  # a model load that outlasts the startup timeout
    return FakeEngine(config)


async def test_the_startup_timeout_is_the_callers_and_its_error_names_the_flag():
    """The timeout was fixed at 600 s; the caller's now bounds the wait, and the error says
    which flag raises it. The engine process is killed, not left loading."""
    from engine_core.errors import ConfigError

    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="within 1 s.*--engine-startup-timeout"):
        await AsyncEngineClient.start(_config(), _hanging_factory, startup_timeout_s=1.0)
    assert time.monotonic() - started < 20
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="must be > 0"):
            await AsyncEngineClient.start(_config(), fake_factory, startup_timeout_s=bad)


async def test_engine_death_fails_in_flight_requests():
    client = await AsyncEngineClient.start(_config("crash"), fake_factory)
    try:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(client, "x", 5), 10)
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await client.call("check_health")
    finally:
        await client.shutdown()


async def test_sigterm_stops_engine_cleanly():
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        os.kill(client.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while client.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not client.is_alive
        assert client._process.exitcode == 0
    finally:
        await client.shutdown()


async def test_a_request_too_large_for_the_engine_socket_is_refused_not_lost():
    """The engine drops a message over its codec's limit as malformed, without a word: the
    request used to wait for outputs forever. The client now refuses to send it (a 400)."""
    client = await AsyncEngineClient.start(_config(), fake_factory)
    try:
        big = {"x": "a" * (ENGINE_INPUT_CODEC.max_bytes + 1)}
        with pytest.raises(InvalidRequestError, match="limit"):
            async for _ in client.generate("big", [1, 2], SamplingParams(max_tokens=2),
                                           kv_transfer_params=big):
                pass
        outputs = [o async for o in client.generate("fine", [1, 2], SamplingParams(max_tokens=2))]
        assert outputs and outputs[-1].finish_reason is not None
    finally:
        await client.shutdown()


def _slow_teardown_factory(config: EngineConfig) -> FakeEngine:
    import atexit

    atexit.register(time.sleep, 2.0)  # stands for torch / CUDA / NCCL teardown at exit
    return FakeEngine(config)


def test_shutdown_while_the_engine_is_exiting_does_not_hang():
    """An engine that closed its sockets but is still tearing down (SIGTERM to the process
    group) takes no "shutdown" message: a blocking send of it froze the API server for
    good. The send no longer blocks, and shutdown waits for the process instead."""
    import threading

    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(AsyncEngineClient.start(_config(), _slow_teardown_factory))
    try:
        os.kill(client.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert client._process.is_alive()  # its sockets are closed, its teardown runs
        done = threading.Event()
        thread = threading.Thread(target=lambda: (loop.run_until_complete(client.shutdown()),
                                                  done.set()), daemon=True)
        thread.start()
        finished = done.wait(12.0)
        if not finished:  # unblock the stuck send so that this process can exit
            context = zmq.Context()
            sock = context.socket(zmq.PULL)
            sock.connect(f"ipc://{client._socket_dir}/input")
            sock.recv()
            sock.close()
            context.term()
            done.wait(10.0)
        assert finished, "shutdown() blocked on its send to an exiting engine"
    finally:
        loop.close()


def test_sleep_listeners_hear_each_change_of_sleep_state_once() -> None:
    """Stats pushed or refreshed tell the listeners only when asleep/awake flips (a worker's
    heartbeat then goes at once); the first stats and unchanged ones tell nothing."""
    client = AsyncEngineClient.__new__(AsyncEngineClient)
    client.latest_stats = None
    client._sleep_listeners = []
    heard: list[int] = []
    client.add_sleep_listener(lambda: heard.append(client.latest_stats.sleep_level))

    def stats(level: int) -> EngineStats:
        return EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, sleep_level=level)

    for level in (0, 0, 1, 2, 1, 0, 0, 2):
        client._take_stats(stats(level))
    assert heard == [1, 0, 2]  # asleep, awake, asleep (the levels 1 -> 2 -> 1 stay asleep)
    assert client.latest_stats.sleep_level == 2
