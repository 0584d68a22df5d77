"""The lane planner: how many workers the cluster keeps free of streams, from the measured
traffic and speeds, and how placement honours the plan (pure)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE, CAPABILITIES
from proxy.lanes import (
    ClusterSpeed,
    LaneConfig,
    LanePlanner,
    Traffic,
    best_lane_size,
    decode_step,
    max_rate,
    measured_speed,
    prefill_utilisation_limit,
    sustainable,
)
from proxy.placement import (
    PLACEMENT_DISAGGREGATED,
    PLACEMENT_LOCAL,
    REASON_LANE,
    REASON_LOCAL,
    REASON_TTFT,
    PlacementConfig,
    WorkerSnapshot,
    place,
)

# An H100 with Qwen3-8B: 41k prompt tokens/s, a 6 ms decode step growing 0.15 ms a 2k
# stream; TPOT 10 ms (step target and limit 9 ms) or 40 ms (36 ms).
TIGHT = ClusterSpeed(41_000.0, 0.006, 0.15e-3, 0.009, 0.009)
LOOSE = ClusterSpeed(41_000.0, 0.006, 0.15e-3, 0.036, 0.036)
PROMPT_HEAVY = Traffic(prompt_tokens=2048, output_tokens=256)
DECODE_HEAVY = Traffic(prompt_tokens=512, output_tokens=1024)
CONFIG = LaneConfig()


def test_decode_step_is_the_fixed_point_of_streams_and_step() -> None:
    # 8 req/s of 256 tokens on one worker: 2048 streams a second of step; a step of s
    # holds 2048 s streams and lasts 6 ms + 0.15 ms each.
    step = decode_step(TIGHT, PROMPT_HEAVY, 8.0, 1)
    assert step == pytest.approx(0.006 + 0.15e-3 * 2048 * step)
    assert decode_step(TIGHT, PROMPT_HEAVY, 8.0, 2) < step
    # Streams arriving faster than steps end them: no step holds.
    assert decode_step(TIGHT, PROMPT_HEAVY, 30.0, 1) == math.inf
    assert decode_step(TIGHT, PROMPT_HEAVY, 1.0, 0) == math.inf


def test_a_long_queue_of_short_prompts_may_run_busier_than_one_of_long_prompts() -> None:
    one_tenth = prefill_utilisation_limit(0.05, 1.0, CONFIG)
    one_half = prefill_utilisation_limit(0.2, 1.0, CONFIG)
    assert 0 < one_half < one_tenth <= CONFIG.max_prefill_utilisation
    assert prefill_utilisation_limit(0.5, 1.0, CONFIG) == 0.0  # alone it misses TTFT


def test_a_tight_tpot_target_wants_a_worker_free_of_streams() -> None:
    # At 10 ms the decode part leaves a decoding worker a sixth of its steps: two mixed
    # workers prefill less than one that only prefills.
    rates = [max_rate(TIGHT, PROMPT_HEAVY, CONFIG, 1.0, 2, k) for k in range(2)]
    assert rates[1] > 1.5 * rates[0] > 0
    assert best_lane_size(rates, 0, 0.1) == 1
    assert sustainable(TIGHT, PROMPT_HEAVY, CONFIG, 1.0, 2, 1, 8.0)
    assert not sustainable(TIGHT, PROMPT_HEAVY, CONFIG, 1.0, 2, 0, 8.0)


def test_decode_heavy_traffic_wants_every_worker_decoding() -> None:
    # 1024-token answers fill the decode steps first: halving the decoders halves the rate.
    rates = [max_rate(LOOSE, DECODE_HEAVY, CONFIG, 1.0, 2, k) for k in range(2)]
    assert rates[0] > 1.5 * rates[1] > 0
    assert best_lane_size(rates, 1, 0.1) == 0


def test_mixed_steps_that_hide_the_weights_read_favour_every_worker_mixing() -> None:
    # A chunk's compute hiding the 6 ms read makes each mixed step carry 6 ms more prompt.
    hiding = dataclasses.replace(TIGHT, hidden_s=0.006)
    plain = max_rate(TIGHT, PROMPT_HEAVY, CONFIG, 1.0, 2, 0)
    assert max_rate(hiding, PROMPT_HEAVY, CONFIG, 1.0, 2, 0) > 1.5 * plain
    # The prefill lane prefills alone: what mixed steps hide does not change it.
    assert (max_rate(hiding, PROMPT_HEAVY, CONFIG, 1.0, 2, 1)
            == max_rate(TIGHT, PROMPT_HEAVY, CONFIG, 1.0, 2, 1))


def test_the_prefill_lane_runs_at_the_rate_of_prefill_alone() -> None:
    # Two H200s at TPOT 10 ms: mixed steps' chunks measure 17k tokens/s at the margin,
    # prompts alone 45k. Planned at the marginal rate, one prefill lane sustains less than
    # both workers mixing; at the rate of prefill alone, far more (1P1D's 22 req/s against
    # two replicas' 14 on those cards).
    marginal = ClusterSpeed(17_300.0, 0.0045, 0.12e-3, 0.009, 0.009, 0.0045)
    alone = dataclasses.replace(marginal, prefill_alone_tokens_per_s=45_000.0)
    assert marginal.lane_rate == 17_300.0 and alone.lane_rate == 45_000.0
    before = [max_rate(marginal, PROMPT_HEAVY, CONFIG, 1.0, 2, k) for k in range(2)]
    after = [max_rate(alone, PROMPT_HEAVY, CONFIG, 1.0, 2, k) for k in range(2)]
    assert before[0] > before[1] and best_lane_size(before, 0, 0.1) == 0
    assert after[0] == before[0]  # mixing workers keep the marginal rate
    assert after[1] > 1.5 * after[0] and best_lane_size(after, 0, 0.1) == 1


def test_the_plan_changes_only_for_a_clear_gain() -> None:
    assert best_lane_size([10.0, 10.5, 9.0], 0, 0.1) == 0
    assert best_lane_size([10.0, 11.5, 9.0], 0, 0.1) == 1
    assert best_lane_size([10.0, 11.5, 9.0], 5, 0.1) == 1  # a lane of workers that left


def snapshot(worker_id: str, *, decoding: int = 0, step_s: float = 0.0,
             capabilities: frozenset[str] = frozenset(CAPABILITIES),
             base_s: float = 0.006, queued: int = 0) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, capabilities, queued_prefill_tokens=queued,
                          prefill_tokens_per_s=41_000.0, decode_batch=decoding,
                          num_decoding=decoding, step_s=step_s, decode_step_target_s=0.009,
                          decode_base_s=base_s)


def test_speed_comes_from_heartbeats_and_needs_each_part() -> None:
    workers = [snapshot("a", decoding=20, step_s=0.009), snapshot("b", decoding=2,
                                                                  step_s=0.0063)]
    speed = measured_speed(workers, 0.009)
    assert speed is not None
    # Growth from the worker with enough decodes to show it: 3 ms over 20 streams.
    assert speed.per_stream_s == pytest.approx(0.15e-3)
    assert (speed.base_s, speed.step_target_s) == (0.006, 0.009)
    assert speed.prefill_alone_tokens_per_s == 0.0  # none ran a prompt alone yet
    assert speed.lane_rate == 41_000.0
    workers[1] = dataclasses.replace(workers[1], prefill_alone_tokens_per_s=90_000.0)
    speed = measured_speed(workers, 0.009)
    assert speed is not None and speed.lane_rate == 90_000.0  # the workers that measured it
    assert measured_speed([snapshot("a", decoding=20, step_s=0.009, base_s=0.0)], 0.009) is None
    # Workers that measured their growth per row give it directly, decoding or not.
    idle = [dataclasses.replace(snapshot("a"), decode_per_row_s=0.09e-3), snapshot("b")]
    speed = measured_speed(idle, 0.009)
    assert speed is not None and speed.per_stream_s == pytest.approx(0.09e-3)
    assert measured_speed([snapshot("a", decoding=2, step_s=0.0063)], 0.009) is None


def feed(planner: LanePlanner, requests: int, prompt: int = 2048, output: int = 256) -> None:
    for _ in range(requests):
        planner.observe_prompt(prompt)
        planner.observe_output(output)


TPOT_10 = PlacementConfig(slo_ttft_s=1.0, slo_tpot_s=0.010)
BUSY = [snapshot("a", decoding=20, step_s=0.009), snapshot("b"), snapshot("c")]


def test_no_plan_until_requests_and_measurements_then_one_that_holds() -> None:
    planner = LanePlanner(LaneConfig(min_requests=8, replan_s=1.0))
    feed(planner, 7)
    assert planner.lane(0.0, BUSY, TPOT_10) is None
    feed(planner, 1)
    idle = [snapshot("a"), snapshot("b"), snapshot("c")]
    assert planner.lane(0.0, idle, TPOT_10) is None  # no decodes: growth unknown
    lane = planner.lane(0.1, BUSY, TPOT_10)
    assert lane is not None and 1 <= len(lane) <= 2 and "a" not in lane
    described = planner.describe()
    assert described["prefill_lane"] == sorted(lane, key=["a", "b", "c"].index)
    assert len(described["sustainable_rps"]) == 3  # type: ignore[arg-type]
    # Within replan_s the plan holds; later, idle heartbeats keep it (nothing to re-choose
    # from).
    assert planner.lane(0.5, idle, TPOT_10) == lane
    assert planner.lane(5.0, idle, TPOT_10) == lane


def test_another_size_needs_replans_in_a_row_and_the_hold() -> None:
    planner = LanePlanner(LaneConfig(min_requests=1, replan_s=1.0, confirm_replans=3,
                                     hold_s=5.0))
    feed(planner, 8)  # 2k prompts, 256 out, TPOT 10 ms: one worker free of streams
    assert planner.lane(0.0, BUSY, TPOT_10) == {"b"}
    feed(planner, 64, prompt=512, output=1024)  # decode-heavy now: every worker decoding
    assert [planner.lane(t, BUSY, TPOT_10) for t in (1.0, 2.0)] == [{"b"}, {"b"}]
    assert planner.lane(3.0, BUSY, TPOT_10) == {"b"}  # three wins, within the hold
    assert planner.lane(5.0, BUSY, TPOT_10) == frozenset()


def test_traffic_that_flips_between_replans_keeps_the_plan() -> None:
    planner = LanePlanner(LaneConfig(min_requests=1, replan_s=1.0, confirm_replans=2,
                                     hold_s=0.0))
    feed(planner, 8)
    assert planner.lane(0.0, BUSY, TPOT_10) == {"b"}
    for second in range(1, 11):
        if second % 2:
            feed(planner, 64, prompt=512, output=1024)
        else:
            feed(planner, 64)
        assert planner.lane(float(second), BUSY, TPOT_10) == {"b"}, second


def test_a_lane_worker_that_leaves_is_replaced_at_once() -> None:
    planner = LanePlanner(LaneConfig(min_requests=1))
    feed(planner, 4)
    lane = planner.lane(0.0, BUSY, TPOT_10)
    assert lane
    gone = next(iter(lane))
    rest = [w for w in BUSY if w.worker_id != gone] + [snapshot("d")]
    after = planner.lane(0.01, rest, TPOT_10)
    assert after is not None and gone not in after and len(after) == len(lane)


def test_only_prefill_capable_workers_join_the_lane() -> None:
    planner = LanePlanner(LaneConfig(min_requests=1))
    feed(planner, 4)
    workers = [snapshot("a", decoding=20, step_s=0.009),
               snapshot("b", capabilities=frozenset({CAP_DECODE})), snapshot("c")]
    lane = planner.lane(0.0, workers, TPOT_10)
    assert lane is not None and "b" not in lane


def test_placement_keeps_streams_off_the_lane_and_prefills_in_it() -> None:
    workers = [snapshot("a", decoding=6, step_s=0.007), snapshot("b", decoding=3,
                                                                 step_s=0.0065),
               snapshot("p")]
    for _ in range(3):
        decision = place(workers, 4096, TPOT_10, frozenset({"p"}))
        # Streams spread over the decode lane (the fewest decodes), never onto the lane.
        assert decision.decode == "b"
        assert decision.placement == PLACEMENT_DISAGGREGATED and decision.prefill == "p"
    # A decode-lane worker never prefills for another, even one that would finish first.
    busy_lane = [snapshot("x", decoding=2, step_s=0.0085), snapshot("y", decoding=3,
                                                                    step_s=0.006),
                 snapshot("p", queued=400_000)]
    decision = place(busy_lane, 4096, TPOT_10, frozenset({"p"}))
    assert decision.placement == PLACEMENT_LOCAL and decision.decode == "x"
    # A decode-lane worker with room to prefill still sends the prompt to the lane while the
    # lane meets the TTFT target (its steps stay its decodes'); past that, it computes it.
    # (x: 0.20 s; the lane: 0.84 s, within the 1 s target.)
    light = [snapshot("x", decoding=2, step_s=0.0045), snapshot("p", queued=30_000)]
    decision = place(light, 4096, TPOT_10, frozenset({"p"}))
    assert (decision.placement, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "p", REASON_LANE)
    late = [snapshot("x", decoding=2, step_s=0.0045), snapshot("p", queued=60_000)]
    decision = place(late, 4096, TPOT_10, frozenset({"p"}))
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "x", REASON_LOCAL)
    # Both miss the target: the sooner one, labelled as such.
    full = [snapshot("x", decoding=30, step_s=0.0088), snapshot("p", queued=60_000)]
    decision = place(full, 4096, TPOT_10, frozenset({"p"}))
    assert (decision.placement, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "p", REASON_TTFT)
    # A D inside the lane (no decoder outside it is left) keeps the plain rules.
    inside = [snapshot("x", decoding=2, step_s=0.0045), snapshot("p", queued=10_000)]
    decision = place(inside, 4096, TPOT_10, frozenset({"p", "x"}))
    assert decision.reason != REASON_LANE
    # Without a lane (the plan is replicas) every request is served whole, spread out.
    decision = place(workers, 4096, TPOT_10, frozenset())
    assert decision.placement == PLACEMENT_LOCAL and decision.decode == "p"
    # Under any plan a worker that cannot serve whole gets its prefill from another, and a
    # worker that cannot decode prefills (it takes no streams either way).
    split = [snapshot("d", capabilities=frozenset({CAP_DECODE})),
             snapshot("q", capabilities=frozenset({CAP_PREFILL, CAP_DECODE}), decoding=1,
                      step_s=0.0065)]
    decision = place(split, 4096, TPOT_10, frozenset())
    assert (decision.placement, decision.decode, decision.prefill) == (
        PLACEMENT_DISAGGREGATED, "d", "q")
    prefill_only = [snapshot("w", decoding=2, step_s=0.0065),
                    snapshot("r", capabilities=frozenset({CAP_PREFILL}))]
    decision = place(prefill_only, 4096, TPOT_10, frozenset())
    assert (decision.decode, decision.prefill) == ("w", "r")
    # With no worker to prefill for it, a decode-only worker takes no stream that a worker
    # serving whole can take (the plan's spread would pick the emptier one).
    no_prefill = [snapshot("d", capabilities=frozenset({CAP_DECODE})),
                  snapshot("e", capabilities=frozenset({CAP_DECODE, CAP_WHOLE}), decoding=3,
                           step_s=0.0065)]
    for lane in (None, frozenset()):
        decision = place(no_prefill, 4096, TPOT_10, lane)
        assert (decision.placement, decision.decode) == (PLACEMENT_LOCAL, "e")
    # A lane of every decoder still serves: the request decodes somewhere.
    only = [snapshot("p", capabilities=frozenset({CAP_PREFILL, CAP_DECODE}))]
    assert place(only, 4096, TPOT_10, frozenset({"p"})).decode == "p"
