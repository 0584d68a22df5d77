"""What the placer tells the policy of a worker: its heartbeat, or the proxy's own fresher
accounting (pure)."""

from __future__ import annotations

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
