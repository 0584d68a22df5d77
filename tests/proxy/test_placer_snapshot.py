"""What the placer tells the policy of a worker: its heartbeat, or the proxy's own fresher
accounting (pure)."""

from __future__ import annotations

import pytest

from engine_core.cluster.messages import CAP_PREFILL, CAP_WHOLE, CAPABILITIES, WorkerLoad
from proxy.placement import PlacementConfig
from proxy.placer import Placer
from proxy.prefix_index import PromptShape
from proxy.registry import WorkerState


def state(load: WorkerLoad, parts: dict[str, int] | None = None) -> WorkerState:
    return WorkerState(role="worker", http_address="h:1", model="m", zmq_address="h:2",
                       version="0", load=load, registered_at=0.0, last_heartbeat=0.0,
                       announced=frozenset(CAPABILITIES), parts_in_flight=parts or {})


def test_a_worker_mid_prefill_is_not_decoding() -> None:
    # A prefill worker with four prompts running mid-prefill decodes nothing: it must read
    # as decode-free (full prefill rate, no stream packed onto it).
    placer = Placer(PlacementConfig())
    snap = placer.snapshot(state(WorkerLoad(num_running=4, num_decoding=0,
                                            prefill_tokens_per_s=40_000.0,
                                            decode_step_target_s=0.012),
                                 {CAP_PREFILL: 4}), PromptShape(2048))
    assert (snap.decode_batch, snap.decode_step_target_s) == (0, 0.012)
    # Decodes the heartbeat reports, or the proxy's decode and whole legs when more.
    snap = placer.snapshot(state(WorkerLoad(num_running=9, num_decoding=7)), PromptShape(10))
    assert snap.decode_batch == 7
    snap = placer.snapshot(state(WorkerLoad(num_decoding=7), {CAP_WHOLE: 9}), PromptShape(10))
    assert snap.decode_batch == 9


def test_the_heartbeat_step_model_gives_the_decode_step_of_the_proxy_batch() -> None:
    # The engine counted no decodes yet (its step: the fixed part), but the proxy sent 20
    # streams there: the policy sees the decode part of 20 rows.
    placer = Placer(PlacementConfig())
    load = WorkerLoad(num_decoding=0, decode_step_s=0.0045, decode_base_s=0.0045,
                      decode_per_row_s=1e-4, prefill_tokens_per_s=20_000.0,
                      prefill_alone_tokens_per_s=44_000.0, decode_hidden_s=0.004)
    snap = placer.snapshot(state(load, {CAP_WHOLE: 20}), PromptShape(10))
    assert snap.decode_batch == 20
    assert snap.step_s == pytest.approx(0.0065)
    assert (snap.prefill_tokens_per_s, snap.prefill_alone_tokens_per_s) == (20_000, 44_000)
    assert (snap.decode_base_s, snap.decode_per_row_s, snap.decode_hidden_s) == (
        0.0045, 1e-4, 0.004)
    # An engine that reports no growth per row: its own decode step stands.
    load = WorkerLoad(num_decoding=3, decode_step_s=0.007, decode_base_s=0.0045)
    assert placer.snapshot(state(load, {CAP_WHOLE: 20}), PromptShape(10)).step_s == 0.007
