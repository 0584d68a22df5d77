"""Scheduler decisions with a fake runner: pure logic, no model, milliseconds."""

from __future__ import annotations

from typing import Any

import pytest

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.kv_connector import ExternalMatch, FinishedTransfers, NullConnectorScheduler
from engine_core.kv_transfer_params import KVTransferParams, KVTransferResult
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool
from engine_core.sched.kv_cache_manager import KVCacheManager
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.sched.scheduler import Scheduler

BLOCK = 4


class FakeRunner:
    """Mimics the runner's bookkeeping; the "model" emits a token derived from the length."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.finished = FinishedTransfers()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            self.computed[cached.request_id] = cached.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            if self.computed[rid] + n == len(tokens):
                token = 3 + len(tokens) % 50
                tokens.append(token)
                req_ids.append(rid)
                sampled.append([token])
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        result.finished_sending = self.finished.sending
        result.finished_recving = self.finished.recving
        result.failed_recving = self.finished.failed_recving
        self.finished = FinishedTransfers()
        return result


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, connector=None, caching=True,
                   policy="recompute") -> Scheduler:
    hasher = BlockHasher(BLOCK)
    manager = KVCacheManager(BlockPool(num_blocks, caching), BLOCK, hasher, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                     CacheConfig(block_size=BLOCK, enable_prefix_caching=caching), manager,
                     connector or NullConnectorScheduler(), max_model_len=256,
                     load_failure_policy=policy)


def make_request(rid: str, n: int, max_tokens: int = 4, start: int = 10, **extra: Any) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + n)), params, **extra)


def run_until_idle(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        outputs.extend(scheduler.update_from_output(out, runner.execute(out)))
    raise AssertionError("scheduler did not become idle")


def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.kv.check_integrity()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks


def test_decodes_are_scheduled_before_new_prefills():
    scheduler, runner = make_scheduler(budget=8), FakeRunner()
    scheduler.add_request(make_request("a", 6))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    scheduler.add_request(make_request("b", 30))
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}


def test_long_prompt_is_chunked_within_budget():
    scheduler, runner = make_scheduler(budget=8), FakeRunner()
    scheduler.add_request(make_request("a", 21, max_tokens=2))
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        outputs = scheduler.update_from_output(out, runner.execute(out))
        assert bool(outputs) == (sum(chunks) == 21)
    assert chunks == [8, 8, 5]
    run_until_idle(scheduler, runner)
    assert_all_free(scheduler)


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_seqs=2, budget=100)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3))
    out = scheduler.schedule()
    assert len(out.num_scheduled_tokens) == 2


def test_preemption_recomputes_latest_and_everything_finishes():
    scheduler, runner = make_scheduler(num_blocks=6, budget=64), FakeRunner()
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 7, max_tokens=6, start=10 * i))
    outputs = run_until_idle(scheduler, runner)
    assert scheduler.counters.num_preemptions > 0
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert finished == {"r0": "length", "r1": "length", "r2": "length"}
    tokens = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(len(t) == 6 for t in tokens.values())
    assert_all_free(scheduler)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 4])
def test_abort_at_any_point_frees_blocks(abort_after_steps):
    scheduler, runner = make_scheduler(budget=8), FakeRunner()
    scheduler.add_request(make_request("a", 20, max_tokens=10))
    scheduler.add_request(make_request("b", 3, max_tokens=10))
    for _ in range(abort_after_steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
    scheduler.abort_requests(["a", "b", "unknown"])
    outputs = run_until_idle(scheduler, runner)
    assert {o.request_id for o in outputs if o.finish_reason == "abort"} == {"a", "b"}
    assert_all_free(scheduler)


REMOTE = KVTransferParams(do_remote_prefill=True)
DONE = KVTransferResult("t", "p:1", 1)


class RemoteConnector(NullConnectorScheduler):
    """Says every prompt but its last token arrives from a remote worker."""

    def __init__(self, hold: bool = False) -> None:
        self.allocated: dict[str, list[int]] = {}
        self.hold = hold

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.kv_transfer_params is None or not request.kv_transfer_params.do_remote_prefill:
            return ExternalMatch()
        return ExternalMatch(request.num_prompt_tokens - 1 - num_computed_tokens, True)

    def update_state_after_alloc(self, request, block_ids, num_local, num_external):
        self.allocated[request.request_id] = list(block_ids)

    def request_finished(self, request, block_ids):
        return self.hold, DONE

    def pins_blocks(self, request):
        return False


def test_remote_kv_request_parks_without_blocking_others():
    connector = RemoteConnector()
    scheduler, runner = make_scheduler(connector=connector), FakeRunner()
    scheduler.add_request(make_request("remote", 10, kv_transfer_params=REMOTE))
    scheduler.add_request(make_request("local", 5))
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["local"]
    assert scheduler.parked["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(connector.allocated["remote"]) == 3  # 9 tokens over blocks of 4
    scheduler.update_from_output(out, runner.execute(out))
    runner.finished.recving = {"remote"}
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["remote"] == 1  # only the last prompt token is computed
    outputs = scheduler.update_from_output(out, runner.execute(out))
    outputs += run_until_idle(scheduler, runner)
    assert any(o.request_id == "remote" and o.finish_reason == "length" for o in outputs)
    assert_all_free(scheduler)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_remote_load(policy):
    scheduler, runner = make_scheduler(connector=RemoteConnector(), policy=policy), FakeRunner()
    scheduler.add_request(make_request("remote", 10, kv_transfer_params=REMOTE))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    runner.finished.failed_recving = {"remote"}
    outputs = run_until_idle(scheduler, runner)
    reasons = [o.finish_reason for o in outputs if o.finish_reason]
    assert reasons == (["length"] if policy == "recompute" else ["error"])
    assert_all_free(scheduler)


def test_finished_request_blocks_held_until_sent():
    scheduler, runner = make_scheduler(connector=RemoteConnector(hold=True)), FakeRunner()
    scheduler.add_request(make_request("p", 9, max_tokens=1))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert outputs[0].finish_reason == "length"
    assert outputs[0].kv_transfer_params == DONE
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_total_blocks
    runner.finished.sending = {"p"}
    run_until_idle(scheduler, runner)
    assert_all_free(scheduler)


@pytest.mark.parametrize("ended", ["recving", "failed_recving"])
def test_request_aborted_mid_load_holds_its_blocks_until_the_load_ends(ended):
    """A consumer request aborted while its KV arrives: its blocks stay allocated (the
    receives still scatter into them) until the worker reports the load's end, landed or
    failed, and are freed then."""
    scheduler, runner = make_scheduler(connector=RemoteConnector(hold=True)), FakeRunner()
    scheduler.add_request(make_request("remote", 10, kv_transfer_params=REMOTE))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    assert "remote" in scheduler.parked
    scheduler.abort_requests(["remote"])
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    assert "remote" in scheduler.held
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_total_blocks
    setattr(runner.finished, ended, {"remote"})
    run_until_idle(scheduler, runner)
    assert not scheduler.held
    assert_all_free(scheduler)


def _run_landing_loads(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 300) -> list:
    """Run to idle, every parked load landing at the next step."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        runner.finished.recving = set(scheduler.parked)
        out = scheduler.schedule()
        outputs.extend(scheduler.update_from_output(out, runner.execute(out)))
    raise AssertionError("scheduler did not become idle")


def _tokens_by_request(outputs: list) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def test_landed_loads_that_fill_the_cache_still_run():
    """Two remote requests of 9 prompt tokens + 4 outputs in a 16-token cache. Parked with
    blocks for only their loaded 8 tokens, both used to land with the cache full, each
    needing a third block for its last prompt token, and nothing ran again. A parked
    request now holds blocks for its whole prompt: the second waits until the first ends."""
    scheduler, runner = make_scheduler(num_blocks=4, connector=RemoteConnector()), FakeRunner()
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, 9, start=100 if rid == "a" else 200,
                                           kv_transfer_params=REMOTE))
    out = scheduler.schedule()
    assert list(scheduler.parked) == ["a"] and scheduler.kv.num_blocks_of("a") == 3
    scheduler.update_from_output(out, runner.execute(out))
    tokens = _tokens_by_request(_run_landing_loads(scheduler, runner))
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 4, "b": 4}
    assert_all_free(scheduler)


def test_a_landed_load_passes_a_head_that_found_no_blocks():
    """A local request grows until it preempts itself and waits at the head for more blocks
    than are free, while a landed remote request behind it owns its blocks: the landed one
    runs (it takes no free block), ends, and its blocks let the head resume. Before, the
    head blocked admission and both waited forever."""
    scheduler, runner = make_scheduler(num_blocks=6, connector=RemoteConnector()), FakeRunner()
    scheduler.add_request(make_request("local", 11, max_tokens=13))  # 24 tokens: 6 blocks
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    scheduler.add_request(make_request("remote", 9, max_tokens=2, start=500,
                                       kv_transfer_params=REMOTE))
    out = scheduler.schedule()
    assert "remote" in scheduler.parked and scheduler.kv.num_free_blocks == 0
    outputs += scheduler.update_from_output(out, runner.execute(out))
    outputs += _run_landing_loads(scheduler, runner)
    assert scheduler.counters.num_preemptions >= 1
    finished = [o.request_id for o in outputs if o.finish_reason]
    assert finished == ["remote", "local"]
    assert {rid: len(t) for rid, t in _tokens_by_request(outputs).items()} == {
        "remote": 2, "local": 13}
    assert_all_free(scheduler)


def test_a_prompt_block_finished_this_step_is_not_hit_by_a_request_admitted_with_it() -> None:
    """A's last prompt token fills its second block in the same step that admits B (A's
    prompt plus one token): B must not take that block as a prefix hit, since its KV is
    written by this very step (a decode-only step writes each new token's K/V inside the
    attention launch, so B's program could read the slot before A's wrote it). B hits
    only the block computed in an earlier step; the step after, the whole run hits."""
    scheduler, runner = make_scheduler(budget=7), FakeRunner()
    a = make_request("A", 8, max_tokens=2)
    scheduler.add_request(a)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"A": 7}
    scheduler.update_from_output(first, runner.execute(first))
    b = Request("B", list(range(10, 19)), SamplingParams(temperature=0.0, max_tokens=2,
                                                        ignore_eos=True))
    scheduler.add_request(b)
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"A": 1, "B": 5}
    (new_b,) = second.scheduled_new_reqs
    assert new_b.num_computed_tokens == BLOCK  # block 0 only: block 1 is being written
    scheduler.update_from_output(second, runner.execute(second))
    c = Request("C", list(range(10, 18)) + [99], SamplingParams(temperature=0.0, max_tokens=1,
                                                                ignore_eos=True))
    scheduler.add_request(c)
    third = scheduler.schedule()
    (new_c,) = third.scheduled_new_reqs
    assert new_c.num_computed_tokens == 2 * BLOCK
    scheduler.update_from_output(third, runner.execute(third))
    run_until_idle(scheduler, runner)
    assert_all_free(scheduler)


def test_prompt_tokens_are_counted_at_the_first_token_as_vllm_does() -> None:
    """``vllm:prompt_tokens`` counts prefills done: a prompt aborted in the queue, or before
    its first token, adds nothing; one whose prefill spans steps counts once, at its end."""
    scheduler, runner = make_scheduler(budget=6), FakeRunner()
    scheduler.add_request(make_request("queued", 30))
    scheduler.abort_requests(["queued"])
    scheduler.add_request(make_request("chunked", 10, start=200))
    scheduler.add_request(make_request("aborted_mid_prefill", 20, start=400))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"chunked": 6}
    scheduler.update_from_output(out, runner.execute(out))
    assert scheduler.counters.prompt_tokens == 0  # no prefill has ended yet
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"chunked": 4, "aborted_mid_prefill": 2}
    scheduler.update_from_output(out, runner.execute(out))
    assert scheduler.counters.prompt_tokens == 10
    scheduler.abort_requests(["aborted_mid_prefill"])
    run_until_idle(scheduler, runner)
    assert scheduler.counters.prompt_tokens == 10
    assert_all_free(scheduler)
