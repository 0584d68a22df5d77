"""The connector's doorbell: rings from any thread wake the engine loop at once."""

from __future__ import annotations

import select
import threading
import time
from typing import Any

import pytest
import zmq

from connectors.p2p_nccl.transport import LandingWatcher
from engine_core import engine_process
from engine_core.doorbell import Doorbell
from engine_core.messages import EngineStats


def readable(bell: Doorbell, timeout_s: float = 0.0) -> bool:
    return bool(select.select([bell.fileno()], [], [], timeout_s)[0])


def test_ring_drain_and_many_rings_never_block() -> None:
    bell = Doorbell()
    try:
        assert not readable(bell)
        bell.ring()
        assert readable(bell)
        bell.drain()
        assert not readable(bell)
        for _ in range(200_000):  # far more than a pipe holds: rings are absorbed
            bell.ring()
        assert readable(bell)
        bell.drain()
        assert not readable(bell)
    finally:
        bell.close()
    bell.ring()  # after close: a no-op, not an error


class _FakeEvent:
    def __init__(self, fail: bool = False) -> None:
        self.done = threading.Event()
        self.fail = fail

    def synchronize(self) -> None:
        assert self.done.wait(5)
        if self.fail:
            raise RuntimeError("stream error")


def test_landing_watcher_calls_back_in_order_after_each_event() -> None:
    calls: list[int] = []
    called = threading.Semaphore(0)
    watcher = LandingWatcher("test-landing")
    events = [_FakeEvent(), _FakeEvent(fail=True), _FakeEvent()]

    def callback(i: int) -> Any:
        def call() -> None:
            calls.append(i)
            called.release()
        return call

    for i, event in enumerate(events):
        watcher.watch(event, callback(i))
    time.sleep(0.05)
    assert calls == []  # nothing completed yet
    for i, event in enumerate(events):
        event.done.set()
        assert called.acquire(timeout=5)
        assert calls == list(range(i + 1))  # a failed wait still calls back
    watcher.stop()


class _TransferOnlyEngine:
    """Busy with transfers only (nothing runnable): the loop waits between steps."""

    def __init__(self, bell: Doorbell) -> None:
        self.bell = bell
        self.steps: list[float] = []

    def doorbell(self) -> Doorbell:
        return self.bell

    def has_work(self) -> bool:
        return True

    def has_runnable(self) -> bool:
        return False

    def step(self) -> list:
        self.steps.append(time.monotonic())
        return []

    def get_stats(self) -> EngineStats:
        raise AssertionError("the test sets a stats interval no run reaches")


@pytest.mark.timeout(60)
def test_doorbell_wakes_a_loop_waiting_on_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the transfer poll made 10 s long, only the doorbell can make the loop step soon."""
    monkeypatch.setattr(engine_process, "_TRANSFER_POLL_MS", 10_000)
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://doorbell-test-in")
    out_pull, out_push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    out_pull.bind("inproc://doorbell-test-out")
    out_push.connect("inproc://doorbell-test-out")
    push.connect("inproc://doorbell-test-in")
    bell = Doorbell()
    engine = _TransferOnlyEngine(bell)
    proc = engine_process.EngineCoreProc(engine, pull, out_push, stats_interval_s=1e9)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the loop is now parked in its 10 s wait
        parked = len(engine.steps)
        for _ in range(3):
            rung = time.monotonic()
            bell.ring()
            deadline = rung + 2.0
            while len(engine.steps) == parked and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(engine.steps) == parked + 1, "the doorbell did not wake the loop"
            assert engine.steps[-1] - rung < 0.5
            time.sleep(0.1)
            assert len(engine.steps) == parked + 1  # drained: no spinning after one ring
            parked += 1
    finally:
        proc.stop()
        bell.ring()
        thread.join(5)
        for sock in (pull, push, out_pull, out_push):
            sock.close(0)
        context.term()
        bell.close()
    assert not thread.is_alive()


@pytest.mark.gpu
def test_landing_watcher_waits_on_a_cuda_event_without_the_gil() -> None:
    """A real blocking-sync CUDA event: the callback comes after the GPU work, and while the
    watcher waits the main thread keeps running Python (the wait does not hold the GIL)."""
    import torch

    torch.cuda.init()
    torch.cuda._sleep(1000)  # load the kernel before timing it (a cold first call is slow)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    landed = threading.Event()
    watcher = LandingWatcher("test-landing-cuda")
    torch.cuda._sleep(int(300 * cycles_per_ms))  # ~300 ms of GPU work
    done = torch.cuda.Event(enable_timing=True, blocking=True)
    done.record()
    issued = time.monotonic()
    watcher.watch(done, landed.set)
    spins = 0
    while not landed.is_set():
        spins += 1  # pure Python: progresses only while this thread holds the GIL
        if time.monotonic() - issued > 10:
            break
    waited = time.monotonic() - issued
    watcher.stop()
    assert landed.is_set() and done.query()
    assert waited > 0.1, f"called back after {waited:.3f} s of ~0.3 s of GPU work"
    assert spins > 100_000, f"main thread starved while the watcher waited ({spins} spins)"
