"""The placement policy: pure decisions on hand-built snapshots (milliseconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE, CAPABILITIES
from proxy.placement import (
    PLACEMENT_DISAGGREGATED,
    PLACEMENT_LOCAL,
    REASON_CACHED,
    REASON_LOCAL,
    REASON_NO_PREFILL,
    REASON_NO_WHOLE,
    REASON_SHORT,
    REASON_SOONER,
    REASON_TPOT,
    REASON_TTFT,
    NoPlacementError,
    PlacementConfig,
    WorkerSnapshot,
    breaks_tpot,
    committed_duty,
    duty_budget,
    duty_with,
    is_tight,
    mean_tpot_s,
    place,
)

ALL = frozenset(CAPABILITIES)
CONFIG = PlacementConfig(slo_ttft_s=1.0, slo_tpot_s=0.040, short_prompt_tokens=256,
                         default_prefill_tokens_per_s=40_000, transfer_overhead_s=0.005,
                         duty_window_s=2.0, tpot_headroom=0.8)


def worker(name: str, caps: frozenset[str] = ALL, **fields: object) -> WorkerSnapshot:
    fields.setdefault("prefill_tokens_per_s", 40_000.0)
    return WorkerSnapshot(worker_id=name, capabilities=caps, **fields)  # type: ignore[arg-type]


def test_short_prompt_stays_where_it_decodes() -> None:
    # b is idle and would prefill sooner, but a short prompt is not worth a transfer.
    workers = [worker("a", decode_batch=3, queued_prefill_tokens=500, step_s=0.010),
               worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 100, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill) == (PLACEMENT_LOCAL, "a", None)
    assert decision.reason == REASON_SHORT


def test_cached_prompt_stays_where_its_prefix_is() -> None:
    # A long prompt whose prefix b holds: b decodes it and computes only the rest.
    workers = [worker("a"), worker("b", decode_batch=2, step_s=0.010, cached_tokens=4000)]
    decision = place(workers, 4100, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "b", REASON_CACHED)
    assert decision.predicted_prefill_s == pytest.approx(100 / 40_000)


def test_duty_budget_admits_a_prefill_beside_decodes_under_the_target() -> None:
    # The policy plans to 0.8 of the 40 ms target: 32 ms. a decodes 10 streams at 20 ms a
    # step: its budget is 1 - 20/32 = 0.375 of its time. A 4096-token prefill is 0.1 s,
    # 0.05 of a 2 s window: with 0.2 already, 0.25 fits (mean TPOT about 20 / 0.75 =
    # 27 ms), so it stays where it finishes first.
    workers = [worker("a", decode_batch=10, step_s=0.020, prefill_duty=0.2),
               worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 4096, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "a", REASON_LOCAL)
    # At 0.36 it would go to 0.41, over its budget: the prefill moves to b.
    workers[0] = worker("a", decode_batch=10, step_s=0.020, prefill_duty=0.36)
    decision = place(workers, 4096, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "a", "b", REASON_TPOT)
    # With a looser target the budget is 1 - 20/80 = 0.75: it stays.
    loose = dataclasses.replace(CONFIG, slo_tpot_s=0.100)
    assert place(workers, 4096, loose).placement == PLACEMENT_LOCAL
    # A worker with no decodes running has nothing to protect, whatever its duty.
    idle = [worker("a", prefill_duty=0.9), worker("b", frozenset({CAP_PREFILL}))]
    assert place(idle, 4096, CONFIG).placement == PLACEMENT_LOCAL


def test_one_long_prefill_counts_by_its_share_of_the_window() -> None:
    # A single 8192-token chunk stalls a's 20 ms steps by 205 ms once; spread over the
    # window it is 0.1 of a's time, within its 0.375 budget: the mean TPOT holds; it stays.
    workers = [worker("a", decode_batch=30, step_s=0.020), worker("b", frozenset({CAP_PREFILL}))]
    assert place(workers, 8192, CONFIG).placement == PLACEMENT_LOCAL
    # A worker whose steps alone miss the target has no budget at all.
    workers[0] = worker("a", decode_batch=30, step_s=0.038)
    assert duty_budget(workers[0], CONFIG) == pytest.approx(1 - 38 / 32)
    assert place(workers, 8192, CONFIG).reason == REASON_TPOT


def test_duty_model() -> None:
    a = worker("a", decode_batch=5, step_s=0.010, prefill_duty=0.25)
    assert mean_tpot_s(a, 0.25) == pytest.approx(0.010 / 0.75)
    assert mean_tpot_s(a, 1.0) == math.inf
    assert duty_with(a, 8000, CONFIG) == pytest.approx(0.25 + 0.2 / 2.0)
    assert duty_budget(a, CONFIG) == pytest.approx(1 - 10 / 32)
    assert not breaks_tpot(a, 8000, CONFIG)
    assert breaks_tpot(a, 60_000, CONFIG)  # 1.5 s of prefill: 0.25 + 0.75 > 0.69
    # Queued prefill is what a new stream surely sees: the duty's part still queued.
    assert committed_duty(a, CONFIG) == 0.0
    queued = worker("q", decode_batch=5, step_s=0.010, prefill_duty=0.25,
                    queued_prefill_tokens=8000)
    assert committed_duty(queued, CONFIG) == pytest.approx(0.1)


def test_tpot_move_goes_where_decodes_are_not_hurt() -> None:
    # a is at its duty budget; c would finish first but its own decodes would break; b has
    # none.
    workers = [worker("a", decode_batch=8, step_s=0.015, prefill_duty=0.5),
               worker("b", frozenset({CAP_PREFILL}), queued_prefill_tokens=2000),
               worker("c", frozenset({CAP_PREFILL, CAP_DECODE}), decode_batch=40,
                      step_s=0.045)]  # over the target already: no decode goes there
    decision = place(workers, 4096, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == ("a", "b", REASON_TPOT)


def test_tpot_move_does_not_blow_the_ttft_target() -> None:
    # b's queue is 2 s deep: moving there would miss TTFT while a meets it, so a keeps it
    # although it is over its duty budget.
    workers = [worker("a", decode_batch=8, step_s=0.015, prefill_duty=0.5),
               worker("b", frozenset({CAP_PREFILL}), queued_prefill_tokens=80_000)]
    decision = place(workers, 4096, CONFIG)
    assert (decision.placement, decision.reason) == (PLACEMENT_LOCAL, REASON_LOCAL)


def test_first_finish_choice() -> None:
    # D has a deep prefill queue; of the two prefillers, c finishes first (faster rate
    # beats a shorter queue).
    workers = [worker("a", queued_prefill_tokens=20_000),
               worker("b", frozenset({CAP_PREFILL}), queued_prefill_tokens=8000,
                      prefill_tokens_per_s=20_000),
               worker("c", frozenset({CAP_PREFILL}), queued_prefill_tokens=12_000,
                      prefill_tokens_per_s=80_000)]
    decision = place(workers, 4000, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "a", "c", REASON_SOONER)
    assert decision.predicted_prefill_s == pytest.approx(16_000 / 80_000 + 0.005)


def test_ttft_reason_when_local_misses_the_target() -> None:
    workers = [worker("a", queued_prefill_tokens=60_000), worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 4000, CONFIG)
    assert (decision.prefill, decision.reason) == ("b", REASON_TTFT)


def test_equal_workers_keep_the_prefill_local() -> None:
    # Equal in everything: moving costs the transfer, so it stays, on the first listed.
    workers = [worker("a"), worker("b")]
    decision = place(workers, 4000, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "a", REASON_LOCAL)
    decision = place(list(reversed(workers)), 4000, CONFIG)
    assert decision.decode == "b"  # the caller's rotation shares ties


def test_tie_on_prefill_finish_goes_to_the_first_listed() -> None:
    workers = [worker("a", queued_prefill_tokens=40_000),
               worker("b", frozenset({CAP_PREFILL})), worker("c", frozenset({CAP_PREFILL}))]
    assert place(workers, 4000, CONFIG).prefill == "b"
    assert place([workers[0], workers[2], workers[1]], 4000, CONFIG).prefill == "c"


def test_a_worker_leaving_leaves_whole_serving() -> None:
    # The prefiller left: the request is served whole where it decodes.
    workers = [worker("a", queued_prefill_tokens=60_000), worker("b", frozenset({CAP_PREFILL}))]
    assert place(workers, 4000, CONFIG).placement == PLACEMENT_DISAGGREGATED
    decision = place(workers[:1], 4000, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "a", REASON_NO_PREFILL)
    with pytest.raises(NoPlacementError):
        place(workers[1:], 4000, CONFIG)  # only a prefiller is left: nobody decodes
    with pytest.raises(NoPlacementError):
        place([], 10, CONFIG)


def test_decode_only_worker_gets_its_prefill_elsewhere() -> None:
    workers = [worker("d", frozenset({CAP_DECODE})), worker("p", frozenset({CAP_PREFILL}))]
    decision = place(workers, 10, CONFIG)  # even a short prompt: d cannot serve it whole
    assert (decision.placement, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "p", REASON_NO_WHOLE)
    decision = place(workers[:1], 10, CONFIG)
    assert (decision.placement, decision.reason) == (PLACEMENT_LOCAL, REASON_NO_PREFILL)


def test_decodes_spread_when_prefills_fit_beside_them() -> None:
    # The cluster's prefill duty shared evenly (0.15) is within every decoding worker's
    # budget (the least: 1 - 50/80): decodes spread as on replicas; workers over the target
    # (their steps stretched by the prefill queued there) and full ones come last.
    loose = dataclasses.replace(CONFIG, slo_tpot_s=0.100)
    workers = [worker("busy", decode_batch=30, step_s=0.030),
               worker("prefilling", decode_batch=1, prefill_duty=0.6, step_s=0.050,
                      queued_prefill_tokens=48_000),  # 50 / (1 - 0.6) = 125 ms: over
               worker("full", decode_batch=0, kv_usage=0.97),
               worker("light", decode_batch=2, step_s=0.010)]
    assert not is_tight(workers, loose)
    assert place(workers, 100, loose).decode == "light"
    slow = [worker("a", decode_batch=4, step_s=0.050), worker("b", decode_batch=2, step_s=0.150)]
    assert place(slow, 100, loose).decode == "a"  # b is over the target
    # Over the target everywhere: the least slow takes it, whatever the batches.
    slow = [worker("a", decode_batch=90, step_s=0.150), worker("b", decode_batch=2,
                                                              step_s=0.120)]
    assert place(slow, 100, CONFIG).decode == "b"
    # Every worker's KV is full: still placed (the engine queues it), on the least full.
    full = [worker("a", kv_usage=0.99), worker("b", kv_usage=0.96)]
    assert place(full, 100, loose).decode == "b"


def test_decodes_pack_when_the_tpot_target_is_tight() -> None:
    # The cluster prefills 0.9 s a second; shared over two workers, 0.45 each is over the
    # decoding worker's budget (1 - 20/32 = 0.375): replicas would break the target.
    # Decodes pack onto the worker already decoding, which leaves the other to prefill.
    workers = [worker("prefiller", prefill_duty=0.8),
               worker("decoding", decode_batch=40, step_s=0.020, prefill_duty=0.1)]
    assert is_tight(workers, CONFIG)
    assert place(workers, 100, CONFIG).decode == "decoding"
    decision = place(workers, 4000, CONFIG)  # 0.05 more duty fits its budget: local
    assert (decision.decode, decision.reason) == ("decoding", REASON_LOCAL)
    workers[1] = worker("decoding", decode_batch=40, step_s=0.020, prefill_duty=0.35)
    decision = place(workers, 4000, CONFIG)  # 0.40 does not: prefilled on the other
    assert (decision.decode, decision.prefill, decision.reason) == (
        "decoding", "prefiller", REASON_TPOT)
    # Past the target the decoding worker takes no more: the next one starts decoding.
    workers = [worker("idle", prefill_duty=0.3, step_s=0.008),
               worker("decoding", decode_batch=60, step_s=0.045)]
    assert place(workers, 100, CONFIG).decode == "idle"
    # A worker that never decoded steps as fast as the fastest that has: with 1.5 s of
    # prefill queued (0.75 of the window) it would give 4 x 20 ms: not for this stream.
    workers = [worker("prefiller", queued_prefill_tokens=60_000, prefill_duty=0.9),
               worker("decoding", decode_batch=40, step_s=0.020)]
    assert place(workers, 100, CONFIG).decode == "decoding"
    workers[1] = worker("decoding", decode_batch=40, step_s=0.060)  # over: least slow
    assert place(workers, 100, CONFIG).decode == "decoding"
    # The same duties with nobody decoding yet: not tight, decodes spread.
    workers = [worker("a", prefill_duty=0.8), worker("b", prefill_duty=0.1)]
    assert not is_tight(workers, CONFIG)


def test_prefill_only_worker_never_decodes() -> None:
    workers = [worker("p", frozenset({CAP_PREFILL})), worker("w", frozenset({CAP_WHOLE}),
                                                             decode_batch=50, step_s=0.03)]
    decision = place(workers, 10, CONFIG)
    assert (decision.decode, decision.placement) == ("w", PLACEMENT_LOCAL)


def test_unmeasured_rate_uses_the_default() -> None:
    a = WorkerSnapshot("a", ALL)  # no rate measured yet
    decision = place([a], 8192, CONFIG)
    assert decision.predicted_prefill_s == pytest.approx(8192 / 40_000)


def test_a_worker_that_has_not_measured_is_taken_as_fast_as_the_fastest() -> None:
    # b just joined: read at the default rate (a tenth of a's), a's queue would look
    # shorter; taken at a's measured rate, b (idle) finishes first.
    a = worker("a", queued_prefill_tokens=8000, prefill_tokens_per_s=40_000)
    b = WorkerSnapshot("b", ALL)
    slow_default = dataclasses.replace(CONFIG, default_prefill_tokens_per_s=4000)
    decision = place([a, b], 4000, slow_default)
    assert (decision.decode, decision.prefill, decision.reason) == ("a", "b", REASON_SOONER)
    assert decision.predicted_prefill_s == pytest.approx(4000 / 40_000 + 0.005)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(slo_tpot_s=0)
    with pytest.raises(ValueError):
        PlacementConfig(kv_full=1.5)
    with pytest.raises(ValueError):
        PlacementConfig(tpot_headroom=0)
    with pytest.raises(ValueError):
        PlacementConfig(duty_window_s=math.nan)
