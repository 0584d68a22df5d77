"""The engine loop does not spin while nothing can be scheduled.

When the waiting queue's head needs blocks that parked requests (waiting for their remote
KV) hold, every step schedules nothing; the loop used to poll its input with a zero timeout
and step again at once, a busy loop that keeps the GIL from the connector threads whose
transfers would free those blocks. Such a step now marks the engine ``stalled``, and the
loop waits up to ``_TRANSFER_POLL_MS`` (a landing transfer rings the doorbell, an input
wakes it) before stepping again.
"""

from __future__ import annotations

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from engine_core.engine_process import _IDLE_POLL_MS, _TRANSFER_POLL_MS, poll_timeout_ms
from engine_core.kv_connector import FinishedTransfers, NullConnectorScheduler, NullConnectorWorker
from engine_core.messages import AddRequest
from engine_core.request import RequestStatus
from engine_core.sampling_params import SamplingParams
from tests.engine_core.test_early_landing import _Landing, _RemotePrompt


def test_a_step_that_schedules_nothing_makes_the_loop_wait(tiny_checkpoint) -> None:
    worker = _Landing(early=True)
    config = EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), num_gpu_blocks_override=8,
                                      async_scheduling=True)
    engine = EngineCore(config, connector=(_RemotePrompt(), worker))
    assert poll_timeout_ms(engine) == _IDLE_POLL_MS
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True).to_dict()
    block = config.cache.block_size
    engine.add_request(AddRequest("remote", list(range(3, 3 + 6 * block + 4)), params, 0.0))
    engine.step()  # parks it: its blocks are held for the load
    assert engine.scheduler.parked["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    engine.add_request(AddRequest("local", list(range(5, 5 + 3 * block)), params, 0.0))
    assert poll_timeout_ms(engine) == 0  # a step may admit it: try at once
    assert engine.step() == []
    assert engine.stalled and engine.scheduler.waiting[0].request_id == "local"
    assert poll_timeout_ms(engine) == _TRANSFER_POLL_MS  # was 0: a busy loop
    assert engine.step() == [] and poll_timeout_ms(engine) == _TRANSFER_POLL_MS
    worker.arrived.add("remote")  # the load lands: the next step computes again
    engine.step()
    assert not engine.stalled and poll_timeout_ms(engine) == 0
    for _ in range(20):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and poll_timeout_ms(engine) == _IDLE_POLL_MS


class _HoldAll(NullConnectorScheduler):
    """Producer: every finished request's blocks are held for a send."""

    def request_finished(self, request, block_ids):
        return True, None


class _Sends(NullConnectorWorker):
    """Reports the sends the test finished, after a step (as the P2P connector does)."""

    def __init__(self) -> None:
        self.sent: set[str] = set()

    def get_finished(self) -> FinishedTransfers:
        sent, self.sent = self.sent, set()
        return FinishedTransfers(sending=sent)


def test_a_send_that_frees_blocks_after_the_pass_ends_the_stall(tiny_checkpoint) -> None:
    """On P the queue's head waits for blocks a finished prefill holds for its send; the send
    ending is applied after the pass, so that step schedules nothing, yet the next can: the
    loop must step at once, not wait (the first version of the stall flag waited 1 ms)."""
    worker = _Sends()
    config = EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), num_gpu_blocks_override=8,
                                      enable_prefix_caching=False)
    engine = EngineCore(config, connector=(_HoldAll(), worker))
    block = config.cache.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("a", list(range(3, 3 + 6 * block)), params, 0.0))
    for _ in range(5):
        engine.step()
        if "a" in engine.scheduler.held and not engine.has_runnable():
            break
    assert "a" in engine.scheduler.held
    engine.add_request(AddRequest("b", list(range(5, 5 + 4 * block)), params, 0.0))
    engine.step()
    assert engine.stalled and poll_timeout_ms(engine) == _TRANSFER_POLL_MS  # b waits for a
    worker.sent.add("a")
    assert engine.step() == []
    assert not engine.stalled and poll_timeout_ms(engine) == 0


def test_a_load_reported_after_the_pass_ends_the_stall(tiny_checkpoint) -> None:
    worker = _Landing(early=False)
    config = EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), num_gpu_blocks_override=32)
    engine = EngineCore(config, connector=(_RemotePrompt(), worker))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("remote", list(range(3, 40)), params, 0.0))
    engine.step()
    assert "remote" in engine.scheduler.parked and engine.stalled
    worker.arrived.add("remote")  # reported by get_finished, after the next pass
    assert engine.step() == []
    assert "remote" in {r.request_id for r in engine.scheduler.landed}
    assert not engine.stalled and poll_timeout_ms(engine) == 0
