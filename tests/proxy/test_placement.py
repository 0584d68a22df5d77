"""The placement policy: pure decisions on hand-built snapshots (milliseconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE, CAPABILITIES
from proxy.placement import (
    MIN_RATE_SHARE,
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
    effective_rate,
    place,
)

ALL = frozenset(CAPABILITIES)
# Plans steps to 0.8 of the 40 ms target: 32 ms.
CONFIG = PlacementConfig(slo_ttft_s=1.0, slo_tpot_s=0.040, short_prompt_tokens=256,
                         default_prefill_tokens_per_s=40_000, transfer_overhead_s=0.005,
                         tpot_headroom=0.8)
TARGET = CONFIG.decode_step_target_s


def worker(name: str, caps: frozenset[str] = ALL, **fields: object) -> WorkerSnapshot:
    """A worker at 40k prompt tokens/s whose engine bounds its mixed steps to TARGET."""
    fields.setdefault("prefill_tokens_per_s", 40_000.0)
    fields.setdefault("decode_step_target_s", TARGET)
    return WorkerSnapshot(worker_id=name, capabilities=caps, **fields)  # type: ignore[arg-type]


def test_short_prompt_stays_where_it_decodes() -> None:
    # b is idle and would prefill sooner, but a short prompt is not worth a transfer.
    workers = [worker("a", decode_batch=3, queued_prefill_tokens=500, step_s=0.010),
               worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 100, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill) == (PLACEMENT_LOCAL, "a", None)
    assert decision.reason == REASON_SHORT


def test_cached_prompt_stays_where_its_prefix_is() -> None:
    # A long prompt whose prefix b holds: b decodes it and computes only the rest, at the
    # rate its decodes leave (32 - 8 ms of each 32 ms step: 30k tokens/s).
    workers = [worker("a"), worker("b", decode_batch=2, step_s=0.008, cached_tokens=4000)]
    decision = place(workers, 4100, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "b", REASON_CACHED)
    assert decision.predicted_prefill_s == pytest.approx(100 / 30_000)


def test_effective_rate_is_capped_while_decoding() -> None:
    # Without decodes a worker prefills at its full rate; while decoding, in the share of
    # each 32 ms step its 24 ms decode part leaves; without a target (its prefills stall
    # its streams instead), at its full rate; at least a small share when the decodes fill
    # the target (the engine still takes a block a step).
    assert effective_rate(worker("idle", step_s=0.024), CONFIG) == 40_000
    assert effective_rate(worker("d", decode_batch=50, step_s=0.024), CONFIG) == pytest.approx(
        10_000)
    assert effective_rate(worker("u", decode_batch=50, step_s=0.024, decode_step_target_s=0.0),
                          CONFIG) == 40_000
    assert effective_rate(worker("f", decode_batch=50, step_s=0.040), CONFIG) == pytest.approx(
        MIN_RATE_SHARE * 40_000)
    # The step time the cluster plans to, and passes to its workers, is the target less
    # the headroom.
    assert CONFIG.decode_step_target_s == pytest.approx(0.032)


def test_decodes_pack_onto_the_workers_that_decode() -> None:
    # The worker already decoding takes the stream, whatever the batch, while its decode
    # step is within the plan: the other stays free of decodes and prefills at full rate.
    workers = [worker("free"), worker("decoding", decode_batch=40, step_s=0.020)]
    decision = place(workers, 4000, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == (
        "decoding", "free", REASON_SOONER)
    assert place(workers, 100, CONFIG).decode == "decoding"
    # Of two decoding, the larger batch.
    workers = [worker("a", decode_batch=10, step_s=0.010),
               worker("b", decode_batch=30, step_s=0.015)]
    assert place(workers, 100, CONFIG).decode == "b"


def test_a_worker_past_the_decode_step_limit_takes_no_more_streams() -> None:
    # decoding's step alone is past 0.9 of the 40 ms target: the next worker starts
    # decoding. Below it, the stream still packs there (its steps then carry a block of
    # prompt at most: the planned 32 ms is behind it).
    workers = [worker("free", step_s=0.008), worker("decoding", decode_batch=90, step_s=0.035)]
    assert place(workers, 100, CONFIG).decode == "decoding"
    workers[1] = worker("decoding", decode_batch=90, step_s=0.037)
    assert place(workers, 100, CONFIG).decode == "free"
    # A worker that never decoded steps as fast as the fastest that has.
    workers[0] = worker("free")
    assert place(workers, 100, CONFIG).decode == "free"
    # Past it everywhere: the least slow takes it, whatever the batches.
    slow = [worker("a", decode_batch=90, step_s=0.150), worker("b", decode_batch=2,
                                                              step_s=0.120)]
    assert place(slow, 100, CONFIG).decode == "b"


def test_full_kv_takes_new_decodes_last() -> None:
    workers = [worker("full", decode_batch=60, step_s=0.010, kv_usage=0.97),
               worker("light", decode_batch=2, step_s=0.010)]
    assert place(workers, 100, CONFIG).decode == "light"
    # Every worker's KV is full: still placed (the engine queues it), on the least full.
    full = [worker("a", kv_usage=0.99), worker("b", kv_usage=0.96)]
    assert place(full, 100, CONFIG).decode == "b"


def test_spillover_goes_to_the_decoding_worker_when_it_finishes_first() -> None:
    # D decodes at 24 ms of its 32 ms steps: it prefills at 10k tokens/s, a 4000-token
    # prompt in 0.4 s. P (no decodes, 40k/s) finishes first while its queue is short...
    workers = [worker("p", queued_prefill_tokens=8000),
               worker("d", decode_batch=50, step_s=0.024)]
    decision = place(workers, 4000, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == ("d", "p", REASON_SOONER)
    assert decision.predicted_prefill_s == pytest.approx(12_000 / 40_000 + 0.005)
    # ...and once P's queue is deeper than D's capped rate makes up for, D prefills it
    # itself, in chunks beside its decodes.
    workers[0] = worker("p", queued_prefill_tokens=16_000)
    decision = place(workers, 4000, CONFIG)
    assert (decision.placement, decision.decode, decision.reason) == (
        PLACEMENT_LOCAL, "d", REASON_LOCAL)
    assert decision.predicted_prefill_s == pytest.approx(4000 / 10_000)


def test_prefill_moves_off_decodes_no_target_protects() -> None:
    # a runs no decode-step target: a prefill there stalls its 8 streams. b finishes no
    # sooner (the transfer's cost) but harms none, and meets the TTFT target.
    unprotected = dict(decode_step_target_s=0.0)
    workers = [worker("a", decode_batch=8, step_s=0.015, **unprotected),
               worker("b", frozenset({CAP_PREFILL}))]
    decision = place(workers, 4096, CONFIG)
    assert (decision.placement, decision.decode, decision.prefill, decision.reason) == (
        PLACEMENT_DISAGGREGATED, "a", "b", REASON_TPOT)
    # Of the prefillers, the one whose decodes are not stalled, though another is sooner.
    workers = [worker("a", decode_batch=8, step_s=0.015, **unprotected),
               worker("b", frozenset({CAP_PREFILL}), queued_prefill_tokens=2000),
               worker("c", frozenset({CAP_PREFILL, CAP_DECODE}), decode_batch=40,
                      step_s=0.045, **unprotected)]
    decision = place(workers, 4096, CONFIG)
    assert (decision.decode, decision.prefill, decision.reason) == ("a", "b", REASON_TPOT)


def test_tpot_move_does_not_blow_the_ttft_target() -> None:
    # b's queue is 2 s deep: moving there would miss TTFT while a meets it, so a keeps it
    # although its decodes stall.
    workers = [worker("a", decode_batch=8, step_s=0.015, decode_step_target_s=0.0),
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


def test_prefill_only_worker_never_decodes() -> None:
    workers = [worker("p", frozenset({CAP_PREFILL})), worker("w", frozenset({CAP_WHOLE}),
                                                             decode_batch=50, step_s=0.03)]
    decision = place(workers, 10, CONFIG)
    assert (decision.decode, decision.placement) == ("w", PLACEMENT_LOCAL)


def test_a_worker_without_decodes_prefills_at_its_rate_of_prefill_alone() -> None:
    # Mixed steps measured 16k tokens/s at the margin, prompts alone 48k: an idle worker
    # is predicted at 48k, a decoding one from the marginal rate (a 24 ms decode part
    # leaves a quarter of each 32 ms step: 4k); until it has run a prompt alone, at 16k.
    idle = worker("idle", prefill_tokens_per_s=16_000, prefill_alone_tokens_per_s=48_000)
    assert effective_rate(idle, CONFIG) == 48_000
    busy = dataclasses.replace(idle, decode_batch=50, step_s=0.024)
    assert effective_rate(busy, CONFIG) == pytest.approx(4_000)
    assert effective_rate(dataclasses.replace(idle, prefill_alone_tokens_per_s=0.0),
                          CONFIG) == 16_000
    # The prediction of a prefill moved to the idle worker uses it.
    decision = place([busy, dataclasses.replace(idle, worker_id="p")], 3200, CONFIG)
    assert (decision.prefill, decision.reason) == ("p", REASON_SOONER)
    assert decision.predicted_prefill_s == pytest.approx(3200 / 48_000 + 0.005)


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
    # Its rate of prefill alone, too: the fastest measured one.
    a = dataclasses.replace(a, prefill_alone_tokens_per_s=100_000)
    b = dataclasses.replace(b, prefill_tokens_per_s=40_000)
    decision = place([a, b], 4000, slow_default)
    assert decision.predicted_prefill_s == pytest.approx(4000 / 100_000 + 0.005)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(slo_tpot_s=0)
    with pytest.raises(ValueError):
        PlacementConfig(kv_full=1.5)
    with pytest.raises(ValueError):
        PlacementConfig(tpot_headroom=0)
    with pytest.raises(ValueError):
        PlacementConfig(decode_step_limit=1.5)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="lane_ttft_share"):
            PlacementConfig(lane_ttft_share=share)
    with pytest.raises(ValueError):
        PlacementConfig(slo_ttft_s=math.nan)
