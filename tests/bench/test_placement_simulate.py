"""The placement simulator: its static layouts behave as queueing says, and the real policy
runs in it (seconds, CPU)."""

from __future__ import annotations

import dataclasses

from benchmarks.placement.search import SloCell
from benchmarks.placement.sim_cluster import GpuModel, SimCluster, SimRequest
from benchmarks.placement.simulate import draw_requests, run_point
from benchmarks.placement.workloads import GPU_WORKLOADS
from proxy.placement import PlacementConfig

GPU = GpuModel()
WORKLOAD = GPU_WORKLOADS["2k"]
TIGHT = SloCell(1000.0, 15.0)


def test_one_request_alone_takes_its_prefill_then_its_decode_steps() -> None:
    request = SimRequest(0.0, 2048, 4)
    SimCluster("replicas", 1, GPU).run([request])
    # The chunk's compute (50 ms) hides the weights' read (the step's 6 ms fixed part).
    prefill_s = max(GPU.decode_step_s(0, 0), 2048 / GPU.prefill_tokens_per_s)
    assert request.ttft is not None and abs(request.ttft - prefill_s) < 1e-9
    # Three more tokens, one a step, each step over the one stream's context.
    expected = sum(GPU.decode_step_s(1, 2049 + i) for i in range(3)) / 3
    assert request.tpot is not None and abs(request.tpot - expected) < 1e-9


def test_disaggregated_request_decodes_after_the_transfer() -> None:
    request = SimRequest(0.0, 2048, 2)
    SimCluster("pd", 2, GPU, num_prefill=1).run([request])
    prefill_s = max(GPU.decode_step_s(0, 0), 2048 / GPU.prefill_tokens_per_s)
    assert request.ttft is not None and abs(request.ttft - prefill_s) < 1e-9
    assert request.tpot is not None and request.tpot > GPU.transfer_s


def test_prefill_queue_grows_past_capacity() -> None:
    # One prefill worker serves ~19 of these prompts a second: below it TTFT stays small,
    # above it the queue (and TTFT) grows with the run.
    low, _ = run_point(lambda _c: SimCluster("pd", 2, GPU, num_prefill=1), TIGHT, WORKLOAD,
                       10.0, 10.0, seed=1)
    high, _ = run_point(lambda _c: SimCluster("pd", 2, GPU, num_prefill=1), TIGHT, WORKLOAD,
                        30.0, 10.0, seed=1)
    assert max(t for t in low.ttfts if t is not None) < 0.5
    assert max(t for t in high.ttfts if t is not None) > 3.0
    # Its decode worker's streams are limited by what the prefill worker admits.
    assert high.attainment(SloCell(1e9, 40.0)) == 1.0


def test_replicas_lose_the_tight_cell_as_their_prefills_stretch_decodes() -> None:
    replicas = lambda _c: SimCluster("replicas", 2, GPU)  # noqa: E731
    assert run_point(replicas, TIGHT, WORKLOAD, 8.0, 10.0, seed=2)[0].attainment(TIGHT) == 1.0
    assert run_point(replicas, TIGHT, WORKLOAD, 24.0, 10.0, seed=2)[0].attainment(TIGHT) < 0.5


def test_adaptive_policy_at_the_cell_target_places_both_ways_within_it() -> None:
    # 12 req/s of 2k prompts (one prefill worker serves ~19): the real policy keeps the
    # tight cell, moving most prefills off the worker that decodes and leaving some beside
    # its decodes. (On H100s the measured adaptive maximum at this cell is 12.5 req/s:
    # docs/PERFORMANCE.md.)
    config = PlacementConfig(slo_tpot_s=0.015)
    adaptive, cluster = run_point(lambda _c: SimCluster("adaptive", 2, GPU, config), TIGHT,
                                  WORKLOAD, 12.0, 20.0, seed=4)
    assert adaptive.attainment(TIGHT) >= 0.9
    assert any(k.startswith("disaggregated/") for k in cluster.placements)
    assert any(k.startswith("local/") for k in cluster.placements)


def test_draw_requests_follows_the_workload() -> None:
    mixed = draw_requests(GPU_WORKLOADS["mixed"], 10.0, 20.0, seed=0)
    assert len(mixed) == 200 and len({r.prompt for r in mixed}) > 50
    assert all(16 <= r.prompt <= 8192 and r.output >= 8 for r in mixed)
    fixed = draw_requests(dataclasses.replace(WORKLOAD), 4.0, 5.0, seed=0)
    assert {(r.prompt, r.output) for r in fixed} == {(2048, 256)}


def test_a_worker_with_a_step_target_bounds_its_mixed_steps_as_the_engine() -> None:
    from benchmarks.placement.sim_cluster import SimWorker, _Prefill
    from engine_core.cluster.messages import CAPABILITIES
    from engine_core.step_rates import StepRates

    def chunk(target_s: float | None) -> int:
        worker = SimWorker("w", frozenset(CAPABILITIES), GPU, target_s)
        worker.rates = StepRates(prefill_tokens_per_s=41_000.0, decode_step_s=0.009)
        worker.join(SimRequest(0.0, 2048, 100), 99, 0.0)  # one stream decoding
        worker.prefills.append(_Prefill(SimRequest(0.0, 8192, 4), 8192, None))
        (_, take), = worker.plan_step()[1]
        return take

    # 3 ms of a 12 ms step at 41k tokens/s: 123 tokens, 112 in whole blocks.
    assert chunk(0.012) == 112
    assert chunk(None) == GPU.max_num_batched_tokens - 1


def test_where_mixed_chunks_run_slow_the_plan_opens_a_prefill_lane() -> None:
    # On H200s a mixed step's prompt tokens run at about 0.4 of the rate of prompts alone.
    # Planned from each rate where it applies, the cluster keeps one worker free of
    # streams and holds the tight cell at 14 req/s, where two replicas lose it.
    gpu = dataclasses.replace(GPU, chunk_rate_share=0.4)
    config = PlacementConfig(slo_tpot_s=0.015)
    adaptive, cluster = run_point(lambda _c: SimCluster("adaptive", 2, gpu, config), TIGHT,
                                  WORKLOAD, 14.0, 10.0, seed=4)
    replicas, _ = run_point(lambda _c: SimCluster("replicas", 2, gpu), TIGHT, WORKLOAD,
                            14.0, 10.0, seed=4)
    assert max(cluster.lane_sizes, key=cluster.lane_sizes.__getitem__) == 1
    assert adaptive.attainment(TIGHT) >= 0.9 > replicas.attainment(TIGHT)
    rates = [(w.rates.prefill_tokens_per_s, w.rates.prefill_alone_tokens_per_s)
             for w in cluster.workers]
    assert all(alone == GPU.prefill_tokens_per_s for _, alone in rates)
    assert 0 < max(mixed for mixed, _ in rates) < 0.5 * GPU.prefill_tokens_per_s
