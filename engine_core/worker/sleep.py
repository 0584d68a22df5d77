"""Sleep mode's weights: let an idle engine give its weights' device memory back, and restore them.

Why: a GPU shared in time (an RL trainer and its rollout engine, several models taking
turns) needs the serving engine's memory back between uses without restarting it. Level 1
keeps a host copy (wake-up is a host-to-device copy); level 2 keeps only the shapes (wake-up
reloads the checkpoint, or re-draws the same dummy weights from the seed). The parameters
stay the same ``nn.Parameter`` objects throughout, so tied weights stay tied and every module
keeps its references; only their storage goes and comes back.

The level-1 host copy is one exact-size pinned buffer (``HostWeights``), made on the first
level-1 sleep and kept by the engine for the next ones: locking ~16 GiB of pages costs
seconds, copying them at bus speed well under one, and a time-shared GPU sleeps again and
again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_core.worker.pinned_memory import HostBuffer

SLEEP_LEVELS = (1, 2)
_ALIGN = 256  # bytes: every parameter's host copy starts aligned for any dtype and the DMA


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * torch.empty((), dtype=dtype).element_size()


class HostWeights:
    """Host memory for one model's parameters, laid out once (a tied parameter once)."""

    def __init__(self, model: nn.Module, pinned: bool) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, param in model.named_parameters():
            self.offsets[name] = total
            total += -(-_nbytes(param.shape, param.dtype) // _ALIGN) * _ALIGN
        self.memory = HostBuffer(total, pinned)

    def fits(self, model: nn.Module) -> bool:
        return list(self.offsets) == [name for name, _ in model.named_parameters()]

    def view(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self.memory.view(self.offsets[name], shape, dtype)


@dataclass
class ReleasedWeights:
    """What a sleeping model keeps of its weights."""

    level: int
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    host: HostWeights | None = None  # level 1 only

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.memory.nbytes


def release_weights(model: nn.Module, level: int,
                    host: HostWeights | None = None) -> ReleasedWeights:
    """Free every parameter's storage; level 1 copies them into ``host`` first (made here
    when not given or laid out for another model; pinned when the model is on CUDA)."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
    params = list(model.named_parameters())
    released = ReleasedWeights(level)
    if level == 1:
        if host is None or not host.fits(model):
            host = HostWeights(model, pinned=any(p.is_cuda for _, p in params))
        released.host = host
        for name, param in params:
            host.view(name, param.shape, param.dtype).copy_(param.data, non_blocking=True)
        if host.memory.pinned:
            torch.cuda.synchronize()  # the copies read the storage freed below
    for name, param in params:
        released.shapes[name] = (param.shape, param.dtype)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return released


def restore_weights(model: nn.Module, released: ReleasedWeights, device: torch.device,
                    reload: Callable[[nn.Module], None]) -> None:
    """Give every parameter its storage back: level 1 from the host copy, level 2 through
    ``reload`` (the loader's checkpoint or dummy fill)."""
    for name, param in model.named_parameters():
        shape, dtype = released.shapes[name]
        param.data = torch.empty(shape, dtype=dtype, device=device)
        if released.host is not None:
            param.data.copy_(released.host.view(name, shape, dtype), non_blocking=True)
    if released.host is not None and released.host.memory.pinned:
        torch.cuda.synchronize(device)
    if released.level == 2:
        reload(model)
