"""The KV connector interface the engine core calls at fixed points, and the no-op connector.

A connector is two objects, not one with a role flag:

* ``ConnectorScheduler`` lives beside the scheduler. It is pure decision logic: how many of a
  request's tokens will arrive from outside, what to do once blocks are allocated, what the
  runner must do this step (metadata placed in ``SchedulerOutput.kv_connector_metadata``),
  and whether a finished request's blocks must be held until a send completes.
* ``ConnectorWorker`` lives beside the model runner. It moves bytes: starts loads, waits per
  layer, saves per layer, and reports finished and failed transfers in the runner output.

The engine core never branches on whether a connector exists: a colocated engine gets the
``NullConnectorScheduler`` / ``NullConnectorWorker`` pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engine_core.attention.metadata import AttentionMetadata
    from engine_core.doorbell import Doorbell
    from engine_core.kv_transfer_params import KVTransferResult
    from engine_core.parallel.kv_layout import PeerRanks
    from engine_core.request import Request
    from engine_core.sched.outputs import SchedulerOutput


@dataclass
class ExternalMatch:
    """Answer of ``get_num_new_matched_tokens``.

    ``num_tokens`` prompt tokens (beyond the local prefix hit) will come from outside; when
    ``is_async`` the request parks in WAITING_FOR_REMOTE_KV until the worker reports them.
    """

    num_tokens: int = 0
    is_async: bool = False


@dataclass
class FinishedTransfers:
    """What the worker side reports after a step."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class ConnectorScheduler(Protocol):
    """Scheduler-side half: decisions only, no devices, sockets or threads."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        """How many tokens after the local prefix hit a remote peer will supply."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_computed_tokens: int, num_external_tokens: int) -> None:
        """Blocks for the request exist now; remember where remote KV must land."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """The metadata the worker side needs for this step (loads to start, layers to save)."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferResult | None]:
        """Return (hold_blocks, the transfer result for the response) for a finished request.
        Held blocks are freed once the request's id is reported in a ``FinishedTransfers``
        (a send done, or a load ended)."""
        ...

    def pins_blocks(self, request: Request) -> bool:
        """True while a running request's blocks must not be freed (a send of them is
        scheduled but not done): the scheduler never preempts such a request."""
        ...

    def update_finished(self, finished: FinishedTransfers) -> None:
        """The worker reported these transfers done; forget their state."""
        ...

    def stats(self) -> dict[str, float]:
        """Gauges and counters for /metrics (pending sends, buffer bytes, ...)."""
        ...

    def is_idle(self) -> bool:
        """True when no transfer state is kept (nothing left for a step to deliver)."""
        ...


class ConnectorWorker(Protocol):
    """Worker-side half: owns transports and moves KV bytes."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None: ...

    def release_kv_caches(self) -> None:
        """Drop every reference to the caches (sleep mode frees them); an idle connector
        only; ``register_kv_caches`` gives it new ones."""
        ...

    def land_loads(self) -> FinishedTransfers:
        """Consumer, before the scheduling pass: loads whose bytes have arrived are scattered
        into the cache (queued on the current stream, ahead of the step about to launch) and
        reported now, with the failed ones, so they run in this pass rather than the next."""
        ...

    def start_load_kv(self, metadata: Any) -> None:
        """Begin (or poll) receives for this step's requests."""
        ...

    def bind_step(self, metadata: Any, attn_metadata: AttentionMetadata) -> None:
        """Remember this step's metadata so the per-layer hooks know what to save."""
        ...

    def needs_layer_hooks(self, metadata: Any) -> bool:
        """Whether this step's ``before_layer``/``after_layer`` do anything; a step without
        them may replay a CUDA graph, which calls no Python between layers."""
        ...

    def before_layer(self, layer_idx: int) -> None:
        """Block until this layer's remote KV has landed (layer-wise loading)."""
        ...

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """This layer's KV for the step is in the cache: gather and send what is due."""
        ...

    def wait_for_save(self) -> None:
        """End of step: synchronous send types complete here."""
        ...

    def get_finished(self) -> FinishedTransfers:
        """Transfers completed or failed since the last call."""
        ...

    def stats(self) -> dict[str, float]:
        """Buffer and transfer gauges (0 when idle) and counters, for /metrics."""
        ...

    def is_idle(self) -> bool:
        """True when no transfer, deadline or buffer byte is held."""
        ...

    def doorbell(self) -> Doorbell | None:
        """Rung from the connector's threads when a transfer lands or fails, so an engine
        loop waiting only on transfers steps at once; None when nothing arrives from outside."""
        ...

    def peer_ranks(self) -> PeerRanks | None:
        """This worker's KV layout and rank addresses as its peers address them (it
        registers them with the proxy); None without a connector."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class RankZeroConnector(Protocol):
    """What rank 0's connector worker of a tensor-parallel engine adds: every rank runs its
    own connector worker (built in the rank's process by ``rank_factory``), rank 0 hands each
    its share of a step's metadata and combines their reports with its own, so its
    ``land_loads`` / ``get_finished`` report a request once every rank it involves ended."""

    @property
    def rank_factory(self) -> str:
        """``module:function`` building a rank's ``RankConnectorWorker`` from (its
        ``EngineConfig``, device): resolved by import in the rank's process."""
        ...

    def rank_shares(self, metadata: Any) -> list[bytes | None]:
        """Ranks 1..N-1's shares of this step's metadata, in the connector's codec (None:
        nothing for that rank); rank 0 keeps its own, which ``start_load_kv`` takes."""
        ...

    def add_rank_report(self, rank: int, report: FinishedTransfers,
                        stats: dict[str, float], idle: bool) -> None:
        """Another rank's finished transfers, its connector's stats now and whether it is
        idle (any thread); rings the doorbell. ``stats()`` sums every rank's, ``is_idle``
        holds only while every rank is."""
        ...

    def rank_lost(self, rank: int) -> None:
        """A rank exited: whatever waits on it ends now (its loads failed)."""
        ...


class RankConnectorWorker(ConnectorWorker, Protocol):
    """A connector worker of rank 1..N-1: an ordinary worker side that reads its share."""

    def decode_share(self, payload: bytes) -> Any:
        """The metadata of one ``rank_shares`` entry."""
        ...


class NullConnectorScheduler:
    """Colocated engines: nothing comes from outside and nothing is held."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        return ExternalMatch()

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_local_computed_tokens: int, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        return None

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferResult | None]:
        return False, None

    def pins_blocks(self, request: Request) -> bool:
        return False

    def update_finished(self, finished: FinishedTransfers) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}

    def is_idle(self) -> bool:
        return True


class NullConnectorWorker:
    """Colocated engines: every hook is a no-op."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        return None

    def release_kv_caches(self) -> None:
        return None

    def land_loads(self) -> FinishedTransfers:
        return FinishedTransfers()

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def bind_step(self, metadata: Any, attn_metadata: AttentionMetadata) -> None:
        return None

    def needs_layer_hooks(self, metadata: Any) -> bool:
        return False

    def before_layer(self, layer_idx: int) -> None:
        return None

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()

    def stats(self) -> dict[str, float]:
        return {}

    def is_idle(self) -> bool:
        return True

    def doorbell(self) -> Doorbell | None:
        return None

    def peer_ranks(self) -> PeerRanks | None:
        return None

    def shutdown(self) -> None:
        return None
