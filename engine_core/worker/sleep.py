"""Sleep mode's weights: let an idle engine give its weights' device memory back, and restore them.

Why: a GPU shared in time (an RL trainer and its rollout engine, several models taking
turns) needs the serving engine's memory back between uses without restarting it. Level 1
keeps a host copy (wake-up is a host-to-device copy); level 2 keeps nothing (wake-up reloads
the checkpoint, or re-draws the same dummy weights from the seed).

A sleepable model's parameters all live in one ``MemoryArena`` (loader.py), so both are one
copy of the whole arena, and waking puts the weights back at the addresses the CUDA graphs
recorded. The level-1 host copy is one exact-size pinned buffer made on the first level-1
sleep and kept for the next ones: locking ~16 GiB of pages costs seconds, copying them at
bus speed well under one, and a time-shared GPU sleeps again and again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.worker.memory_arena import MemoryArena
from engine_core.worker.pinned_memory import HostBuffer

SLEEP_LEVELS = (1, 2)
# What ``wake_up(tags=...)`` may wake (vLLM's names); all of them by default.
WAKE_UP_TAGS = ("weights", "kv_cache")


@dataclass
class ReleasedWeights:
    """What a sleeping model keeps of its weights."""

    level: int
    host: HostBuffer | None = None  # level 1 only: the arena's bytes

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes


def release_weights(arena: MemoryArena, level: int,
                    host: HostBuffer | None = None) -> ReleasedWeights:
    """Give the weights' memory back; level 1 copies it into ``host`` first (made here when
    not given or of another size; pinned when the arena is on CUDA)."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
    released = ReleasedWeights(level)
    if level == 1:
        if host is None or host.nbytes != arena.nbytes:
            host = HostBuffer(arena.nbytes, pinned=arena.device.type == "cuda")
        host.tensor.copy_(arena.tensor, non_blocking=True)
        released.host = host
    arena.release()  # waits for the copy on CUDA
    return released


def restore_weights(arena: MemoryArena, released: ReleasedWeights,
                    reload: Callable[[], None]) -> None:
    """The weights' memory back at the same addresses: level 1 from the host copy, level 2
    through ``reload`` (the loader's checkpoint or dummy fill, in place)."""
    arena.restore()
    if released.host is not None:
        arena.tensor.copy_(released.host.tensor, non_blocking=True)
        if arena.device.type == "cuda":
            torch.cuda.synchronize(arena.device)
    else:
        reload()


class PhaseClock:
    """Seconds spent in each named phase of a sleep or wake-up, in order."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self._last, 4)
        self._last = now

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> str:
        return ", ".join(f"{name[:-2]} {seconds:.2f} s" for name, seconds in self.phases.items())
