"""Preemption never picks a request already scheduled in the same step.

When every request after the one that needs blocks is pinned by the connector (a producer
between its save step and the end of its send), the victim search used to fall back on an
older request already given tokens in this step: its blocks were freed and handed to the
newer request within the same step, and the runner was told both to forget it and to run it.
"""

from __future__ import annotations

import pytest

from engine_core import LLM, SamplingParams
from engine_core.kv_connector import NullConnectorScheduler
from engine_core.messages import AddRequest
from engine_core.request import RequestStatus
from tests.engine_core.test_scheduler import FakeRunner, make_request, make_scheduler


class PinsOne(NullConnectorScheduler):
    """Pins the blocks of one request id, as a producer with a send in progress."""

    def __init__(self, pinned: str) -> None:
        self.pinned = pinned

    def pins_blocks(self, request) -> bool:
        return request.request_id == self.pinned


def test_scheduled_request_is_never_the_victim():
    scheduler, runner = make_scheduler(num_blocks=4, budget=64, connector=PinsOne("b")), FakeRunner()
    scheduler.add_request(make_request("a", 4, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8, start=50))
    for _ in range(6):
        out = scheduler.schedule()
        for request_id in out.num_scheduled_tokens:
            assert request_id not in out.finished_req_ids
            assert out.scheduled_requests[request_id].status == RequestStatus.RUNNING
        scheduler.kv.check_integrity()
        scheduler.update_from_output(out, runner.execute(out))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_survives_a_pinned_newest_request(tiny_checkpoint, async_scheduling):
    """The runner used to raise KeyError on the preempted-yet-scheduled request."""
    llm = LLM(str(tiny_checkpoint("llama")), block_size=4, num_gpu_blocks_override=4,
              max_num_batched_tokens=64, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.scheduler.connector = PinsOne("b")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True).to_dict()
    engine.add_request(AddRequest("a", [5, 6, 7, 8], params, 0.0))
    engine.add_request(AddRequest("b", list(range(50, 58)), params, 0.0))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(8):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.kv_manager.check_integrity()
    assert tokens["a"] and tokens["b"]
