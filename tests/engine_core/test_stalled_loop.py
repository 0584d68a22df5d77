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
