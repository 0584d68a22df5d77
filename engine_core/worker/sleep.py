"""Sleep mode's weights: let an idle engine give its weights' device memory back, and restore them.

Why: a GPU shared in time (an RL trainer and its rollout engine, several models taking
turns) needs the serving engine's memory back between uses without restarting it. Level 1
keeps a host copy (wake-up is a host-to-device copy); level 2 keeps only the shapes (wake-up
reloads the checkpoint, or re-draws the same dummy weights from the seed). The parameters
stay the same ``nn.Parameter`` objects throughout, so tied weights stay tied and every module
keeps its references; only their storage goes and comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

SLEEP_LEVELS = (1, 2)


@dataclass
class ReleasedWeights:
    """What a sleeping model keeps of its weights."""

    level: int
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # level 1 only

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())


def release_weights(model: nn.Module, level: int) -> ReleasedWeights:
    """Free every parameter's storage (level 1: after copying it to host memory, pinned
    when the model is on CUDA so wake-up copies at full speed)."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
    released = ReleasedWeights(level)
    for name, param in model.named_parameters():  # a tied parameter once
        released.shapes[name] = (param.shape, param.dtype)
        if level == 1:
            copy = torch.empty(param.shape, dtype=param.dtype, device="cpu",
                               pin_memory=param.is_cuda)
            copy.copy_(param.data)
            released.host[name] = copy
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return released


def restore_weights(model: nn.Module, released: ReleasedWeights, device: torch.device,
                    reload: Callable[[nn.Module], None]) -> None:
    """Give every parameter its storage back: level 1 from the host copy, level 2 through
    ``reload`` (the loader's checkpoint or dummy fill)."""
    for name, param in model.named_parameters():
        shape, dtype = released.shapes[name]
        param.data = torch.empty(shape, dtype=dtype, device=device)
        if released.level == 1:
            param.data.copy_(released.host[name])
    if released.level == 2:
        reload(model)
