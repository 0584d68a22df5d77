"""Model-based fuzz of the scheduler and the KV cache manager, remote loads included.

The fake runner keeps token ids as the "KV" of each block slot and checks, at every step,
that a request reads back exactly its own tokens before it computes more; a fake consumer
connector parks remote requests and writes their "KV" when their load lands (or fails it).
Each run must end (no wedge, no livelock), hand every block back, and give every request
the tokens a plain reference loop gives, whatever the cache size, block size, budget,
max_num_seqs, chunking, caching, async scheduling and aborts. A decode worker whose landed
loads filled its cache used to stop scheduling for good (2026-11-26); this found it.
"""

from __future__ import annotations

import logging
import random

import pytest

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.kv_connector import ExternalMatch, FinishedTransfers, NullConnectorScheduler
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool
from engine_core.sched.kv_cache_manager import KVCacheManager
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.sched.scheduler import Scheduler

MAX_STEPS = 3000


def next_token(tokens: list[int]) -> int:
    """The fake model: a token that depends on every earlier one."""
    return (sum(t * (i + 7) for i, t in enumerate(tokens)) * 2654435761 >> 7) % 40 + 3


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


class SlotRunner:
    """Writes each computed token id into its KV slot and checks every slot it reads."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.states: dict[str, dict] = {}

    def write(self, block_ids: list[int], first: int, tokens: list[int]) -> None:
        for pos in range(first, first + len(tokens)):
            self.slots[(block_ids[pos // self.block_size], pos % self.block_size)] = tokens[pos - first]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.states[new.request_id] = {"tokens": list(new.token_ids),
                                           "table": list(new.block_ids),
                                           "computed": new.num_computed_tokens}
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            state["table"] += cached.new_block_ids
            assert state["computed"] == cached.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            state = self.states[rid]
            tokens, table, done = state["tokens"], state["table"], state["computed"]
            assert len(table) * self.block_size >= done + n, f"{rid}: block table too short"
            for pos in range(done):
                slot = (table[pos // self.block_size], pos % self.block_size)
                assert self.slots.get(slot) == tokens[pos], f"{rid}: wrong KV at {pos}"
            self.write(table, done, tokens[done:done + n])
            state["computed"] = done + n
            if done + n == len(tokens):
                tokens.append(next_token(tokens))
                req_ids.append(rid)
                sampled.append([tokens[-1]])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


class FakeConsumer(NullConnectorScheduler):
    """Remote requests get all their prompt but the last token from a "producer"."""

    def __init__(self) -> None:
        self.loads: dict[str, tuple[list[int], int, int, list[int]]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.kv_transfer_params is None or not request.kv_transfer_params.do_remote_prefill:
            return ExternalMatch()
        num = max(0, request.num_prompt_tokens - 1 - num_computed_tokens)
        return ExternalMatch(num, num > 0)

    def update_state_after_alloc(self, request, block_ids, num_local, num_external):
        self.loads[request.request_id] = (list(block_ids), num_local, num_external,
                                          list(request.token_ids))

    def request_finished(self, request, block_ids):
        # A load still in flight writes into the blocks: held until it is reported.
        return request.request_id in self.loads, None

    def update_finished(self, finished: FinishedTransfers) -> None:
        for rid in finished.recving | finished.failed_recving:
            self.loads.pop(rid, None)


def run_one(seed: int, aborts: bool) -> int:
    rng = random.Random(seed)
    block = rng.choice([1, 2, 4])
    num_blocks = rng.randint(6, 30)
    capacity = num_blocks * block
    chunked = rng.random() < 0.8
    budget = rng.randint(1, 40) if chunked else capacity + rng.randint(0, 10)
    max_seqs = rng.randint(1, 6)
    caching = rng.random() < 0.8
    async_steps = rng.random() < 0.5
    manager = KVCacheManager(BlockPool(num_blocks, caching), block, BlockHasher(block), caching)
    connector = FakeConsumer()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                          enable_chunked_prefill=chunked),
                          CacheConfig(block_size=block, enable_prefix_caching=caching), manager,
                          connector, max_model_len=10**6)
    runner = SlotRunner(block)
    shared = [rng.randrange(3, 43) for _ in range(capacity)]
    arrivals = []
    for i in range(rng.randint(1, 14)):
        length = rng.randint(2, capacity - 1)
        common = rng.randint(0, length) if rng.random() < 0.5 else 0
        prompt = shared[:common] + [rng.randrange(3, 43) for _ in range(length - common)]
        arrivals.append((rng.randint(0, 10), f"r{i}", prompt, rng.randint(1, capacity - length),
                         rng.random() < 0.6))
    expected: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}
    aborted: set[str] = set()
    in_flight = None

    def collect(outputs) -> None:
        for o in outputs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)

    for step in range(MAX_STEPS):
        for arrival in [a for a in arrivals if a[0] <= step]:
            arrivals.remove(arrival)
            _, rid, prompt, max_tokens, remote = arrival
            scheduler.add_request(Request(
                rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True),
                kv_transfer_params=KVTransferParams(do_remote_prefill=True) if remote else None))
            expected[rid] = reference(prompt, max_tokens)
        if aborts and scheduler.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests([rid])
            aborted.add(rid)
        landed, failed = set(), set()
        for rid, (block_ids, num_local, num_external, tokens) in list(connector.loads.items()):
            if rng.random() < 0.3:
                if rng.random() < 0.1:
                    failed.add(rid)
                else:
                    runner.write(block_ids, num_local, tokens[num_local:num_local + num_external])
                    landed.add(rid)
        if landed or failed:
            collect(scheduler.apply_finished_transfers(
                FinishedTransfers(recving=landed, failed_recving=failed)))
        if not arrivals and not scheduler.has_unfinished() and in_flight is None:
            break
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_seqs
        result = runner.execute(out)
        if in_flight is not None:
            collect(scheduler.update_from_output(*in_flight))
            in_flight = None
        if async_steps and result.req_ids:
            in_flight = (out, result)
        else:
            collect(scheduler.update_from_output(out, result))
        manager.check_integrity()
    else:
        raise AssertionError(f"seed {seed}: no end after {MAX_STEPS} steps (wedged)")
    assert manager.num_free_blocks == manager.num_total_blocks, f"seed {seed}: blocks leaked"
    for rid, tokens in expected.items():
        if rid not in aborted:
            assert results.get(rid) == tokens, f"seed {seed}: {rid} got other tokens"
    return scheduler.counters.num_preemptions


@pytest.mark.parametrize("aborts", [False, True], ids=["no-aborts", "aborts"])
def test_scheduler_fuzz_with_remote_loads(aborts: bool) -> None:
    logging.getLogger("pdserve.scheduler").setLevel(logging.ERROR)  # preemption warnings
    preempted = sum(run_one(seed, aborts) > 0 for seed in range(150))
    assert preempted > 20  # the runs do reach cache pressure
