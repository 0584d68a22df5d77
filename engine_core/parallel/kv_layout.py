"""A tensor-parallel worker's KV cache as KV transfer sees it, and as peers exchange it.

``kv_head_range`` is which KV heads each rank holds (the rule the cache, the attention
kernels and KV transfer share); ``KVLayout`` describes one rank's paged cache (its heads
and the model shape both sides of a transfer must share); ``PeerRanks`` is a whole worker as its
peers address it: a layout and each rank's connector address. A worker registers its
``PeerRanks`` with the proxy, which hands each side the other's in ``kv_transfer_params``;
``PeerRanks.from_wire`` validates a received one once. How two layouts map onto each other is
the connector's (``connectors/p2p_nccl/kv_layout.py``). Pure: no device, socket or thread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from engine_core.addresses import is_host_port
from engine_core.errors import ConfigError, KVTransferError

if TYPE_CHECKING:
    import torch

MAX_TP_SIZE = 1024


@dataclass(frozen=True)
class HeadSlice:
    """KV heads ``[start, start + count)`` of a cache block ``[block_size, heads, head_dim]``.
    A slice of a block is strided, so it is copied by ``index_select``/``index_copy_`` (on
    CUDA too) rather than the contiguous chunk kernel; the whole block keeps that kernel."""

    start: int
    count: int

    def of(self, layers: torch.Tensor) -> torch.Tensor:
        """The slice of a ``[..., heads, head_dim]`` tensor (a view)."""
        return layers.narrow(-2, self.start, self.count)

    def is_whole(self, layers: torch.Tensor) -> bool:
        return self.start == 0 and self.count == layers.shape[-2]


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank ``rank`` of ``size`` holds: ``num_kv_heads / size``
    each, or, with fewer KV heads than ranks, one head replicated on ``size / num_kv_heads``
    consecutive ranks. The one rule the cache, the attention kernels and KV transfer share."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ConfigError(f"{num_kv_heads} KV heads do not split over "
                              f"--tensor-parallel-size {size}")
        kv_per_rank = num_kv_heads // size
        return rank * kv_per_rank, kv_per_rank
    if size % num_kv_heads:
        raise ConfigError(f"--tensor-parallel-size {size} is not a multiple of the "
                          f"{num_kv_heads} KV heads (needed to replicate them)")
    return rank * num_kv_heads // size, 1


class KVLayoutError(KVTransferError):
    """A producer and a consumer whose KV caches cannot be mapped onto each other."""


@dataclass(frozen=True)
class KVLayout:
    """One rank's paged KV cache as KV transfer sees it: the worker's tensor-parallel size,
    this rank and the KV heads it holds, and the model shape both sides must share."""

    tp_size: int
    rank: int
    kv_head_start: int
    num_kv_heads: int  # held by this rank
    total_kv_heads: int  # of the model
    head_dim: int
    block_size: int
    dtype: str
    num_layers: int

    @classmethod
    def of_rank(cls, tp_size: int, rank: int, total_kv_heads: int, head_dim: int,
                block_size: int, dtype: str, num_layers: int) -> KVLayout:
        """The layout of rank ``rank`` of a worker of ``tp_size`` ranks."""
        start, count = kv_head_range(total_kv_heads, rank, tp_size)
        return cls(tp_size, rank, start, count, total_kv_heads, head_dim, block_size, dtype,
                   num_layers)

    @property
    def model_shape(self) -> tuple[int, int, int, str, int]:
        """What producer and consumer must agree on, whatever their sizes."""
        return (self.total_kv_heads, self.head_dim, self.block_size, self.dtype,
                self.num_layers)

    def rank_layout(self, rank: int) -> KVLayout:
        """The layout of another rank of the same worker."""
        return KVLayout.of_rank(self.tp_size, rank, *self.model_shape)


def check_layout(layout: KVLayout) -> str | None:
    """Why ``layout`` cannot describe a rank of a worker (a peer's descriptor is checked
    before it is used), or None."""
    if not 1 <= layout.tp_size <= MAX_TP_SIZE or not 0 <= layout.rank < layout.tp_size:
        return f"rank {layout.rank} of tensor-parallel size {layout.tp_size} out of range"
    if min(layout.total_kv_heads, layout.head_dim, layout.block_size, layout.num_layers) < 1:
        return (f"KV heads {layout.total_kv_heads}, head dim {layout.head_dim}, block size "
                f"{layout.block_size}, layers {layout.num_layers}: all must be positive")
    try:
        expected = kv_head_range(layout.total_kv_heads, layout.rank, layout.tp_size)
    except ConfigError as exc:
        return str(exc)
    if (layout.kv_head_start, layout.num_kv_heads) != expected:
        return (f"rank {layout.rank} of {layout.tp_size} claims KV heads "
                f"[{layout.kv_head_start}, +{layout.num_kv_heads}); it holds "
                f"[{expected[0]}, +{expected[1]})")
    return None

def layout_mismatch(producer: KVLayout, consumer: KVLayout) -> str | None:
    """Why a producer of layout ``producer`` cannot fill a consumer of layout ``consumer``
    (each checked, then the model shape they must share), or None."""
    for side, layout in (("producer", producer), ("consumer", consumer)):
        reason = check_layout(layout)
        if reason is not None:
            return f"{side} layout: {reason}"
    names = ("KV heads", "head dim", "block size", "cache dtype", "layers")
    for name, ours, theirs in zip(names, producer.model_shape, consumer.model_shape,
                                  strict=True):
        if ours != theirs:
            return (f"{name} differ: producer has {ours}, consumer has {theirs} (the same "
                    "model, cache dtype and block size on both sides is required)")
    return None


@dataclass(frozen=True)
class PeerRanks:
    """A worker as transfers between layouts address it: its layout (any rank's; the model
    shape and size are what count) and each rank's connector address, rank 0 first."""

    layout: KVLayout
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.addresses) != self.layout.tp_size:
            raise KVLayoutError(f"peer of tensor-parallel size {self.layout.tp_size} gave "
                                f"{len(self.addresses)} rank addresses")

    @classmethod
    def one_rank(cls, address: str, model_shape: tuple[int, int, int, str, int]) -> PeerRanks:
        """A worker that registered no ranks, as its peers take it: one rank at ``address``
        of the model shape the other side has."""
        return cls(KVLayout.of_rank(1, 0, *model_shape), (address,))

    @property
    def address(self) -> str:
        """Rank 0's connector address: the worker's KV address (grants and
        ``remote_kv_address`` name it)."""
        return self.addresses[0]

    def to_wire(self) -> dict[str, object]:
        """The form peers exchange (registration, ``kv_transfer_params``)."""
        return {"layout": asdict(self.layout), "addresses": list(self.addresses)}

    @classmethod
    def from_wire(cls, value: object) -> PeerRanks:
        """A peer's ranks from the network, validated once here: raises ``KVLayoutError``
        naming what is wrong (missing or mistyped field, a layout no rank holds, an address
        that is not ``host:port``)."""
        if not isinstance(value, dict) or set(value) != {"layout", "addresses"}:
            raise KVLayoutError("peer ranks must be {layout, addresses}")
        raw, addresses = value["layout"], value["addresses"]
        names = [f.name for f in fields(KVLayout)]
        if not isinstance(raw, dict) or sorted(raw) != sorted(names):
            raise KVLayoutError(f"peer layout must have exactly the fields {names}")
        for name in names:
            kind = str if name == "dtype" else int
            if type(raw[name]) is not kind:
                raise KVLayoutError(f"peer layout field {name} must be {kind.__name__}")
        layout = KVLayout(**raw)
        reason = check_layout(layout)
        if reason is not None:
            raise KVLayoutError(f"peer layout: {reason}")
        if (not isinstance(addresses, list) or len(addresses) > MAX_TP_SIZE
                or not all(is_host_port(address) for address in addresses)):
            raise KVLayoutError("peer rank addresses must be a list of host:port")
        return cls(layout, tuple(addresses))
