"""The placement policy: pure decisions on hand-built snapshots (milliseconds)."""

from __future__ import annotations

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
    place,
)

ALL = frozenset(CAPABILITIES)
CONFIG = PlacementConfig(slo_ttft_s=1.0, slo_tpot_s=0.040, short_prompt_tokens=256,
                         prefill_chunk_tokens=2048, default_prefill_tokens_per_s=40_000,
                         transfer_overhead_s=0.005)


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


def test_prefill_moves_off_a_worker_at_its_tpot_limit() -> None:
    # a decodes 10 streams at 20 ms a step; a 2048-token chunk at 40k tokens/s adds 51 ms
    # to its steps, over the 40 ms target; b runs no decodes: the prefill moves to b.
    workers = [worker("a", decode_batch=10, step_s=0.020), worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 4096, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "a", "b", REASON_TPOT)
    # With a looser target the chunk fits beside a's decodes: it stays.
    loose = PlacementConfig(**{**CONFIG.__dict__, "slo_tpot_s": 0.100})
    assert place(workers, 4096, loose).placement == PLACEMENT_LOCAL
    # A worker with no decodes running has nothing to protect.
    idle = [worker("a"), worker("b", frozenset({CAP_PREFILL}))]
    assert place(idle, 4096, CONFIG).placement == PLACEMENT_LOCAL


def test_tpot_move_goes_where_decodes_are_not_hurt() -> None:
    # c would finish first but its own decodes would break; b has none.
    workers = [worker("a", decode_batch=8, step_s=0.015),
               worker("b", frozenset({CAP_PREFILL}), queued_prefill_tokens=2000),
               worker("c", frozenset({CAP_PREFILL, CAP_DECODE}), decode_batch=40,
                      step_s=0.045)]  # over the target already: no decode goes there
    decision = place(workers, 4096, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == ("a", "b", REASON_TPOT)


def test_tpot_move_does_not_blow_the_ttft_target() -> None:
    # b's queue is 2 s deep: moving there would miss TTFT while a meets it, so a keeps it.
    workers = [worker("a", decode_batch=8, step_s=0.015),
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
    # A 2048-token chunk adds 51 ms: within a 100 ms target, so decodes spread as on
    # replicas; workers over the target (or prefilling past it) and full ones come last.
    loose = PlacementConfig(**{**CONFIG.__dict__, "slo_tpot_s": 0.100})
    workers = [worker("busy", decode_batch=30, step_s=0.030),
               worker("prefilling", decode_batch=1, queued_prefill_tokens=30_000,
                      step_s=0.060),  # 60 + 51 ms: over
               worker("full", decode_batch=0, kv_usage=0.97),
               worker("light", decode_batch=2, step_s=0.010)]
    assert place(workers, 100, loose).decode == "light"
    slow = [worker("a", decode_batch=4, step_s=0.050), worker("b", decode_batch=2, step_s=0.150)]
    assert place(slow, 100, loose).decode == "a"  # b is over the target
    # Every worker's KV is full: still placed (the engine queues it), on the least full.
    full = [worker("a", kv_usage=0.99), worker("b", kv_usage=0.96)]
    assert place(full, 100, loose).decode == "b"


def test_decodes_pack_when_the_tpot_target_is_tight() -> None:
    # A chunk beside decodes breaks 40 ms everywhere: decodes pack onto the worker already
    # decoding (within the target), which leaves the idle one to prefill long prompts.
    workers = [worker("idle"), worker("decoding", decode_batch=6, step_s=0.012)]
    assert place(workers, 100, CONFIG).decode == "decoding"
    decision = place(workers, 4000, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == (
        "decoding", "idle", REASON_TPOT)
    # Past the target the decoding worker takes no more: the next one starts decoding.
    workers = [worker("idle"), worker("decoding", decode_batch=60, step_s=0.045)]
    assert place(workers, 100, CONFIG).decode == "idle"
    # The prefilling worker (its queue rides along its steps) is over the target too.
    workers = [worker("prefiller", queued_prefill_tokens=4000),
               worker("decoding", decode_batch=6, step_s=0.012)]
    assert place(workers, 100, CONFIG).decode == "decoding"


def test_prefill_only_worker_never_decodes() -> None:
    workers = [worker("p", frozenset({CAP_PREFILL})), worker("w", frozenset({CAP_WHOLE}),
                                                             decode_batch=50, step_s=0.03)]
    decision = place(workers, 10, CONFIG)
    assert (decision.decode, decision.placement) == ("w", PLACEMENT_LOCAL)


def test_unmeasured_rate_uses_the_default() -> None:
    a = WorkerSnapshot("a", ALL)  # no rate measured yet
    decision = place([a], 8192, CONFIG)
    assert decision.predicted_prefill_s == pytest.approx(8192 / 40_000)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(slo_tpot_s=0)
    with pytest.raises(ValueError):
        PlacementConfig(kv_full=1.5)
