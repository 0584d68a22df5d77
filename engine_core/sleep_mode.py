"""Sleep mode of an engine: its weights' and KV cache's device memory given back and restored.

A mixin of ``EngineCore``. The memory arenas (``worker/memory_arena.py``) keep every
tensor's address, so the CUDA graphs replay after a wake-up as they were; the phases and
their host copies are ``worker/sleep.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine_core.errors import InvalidRequestError
from engine_core.worker.loader import load_weights
from engine_core.worker.sleep import (
    SLEEP_LEVELS,
    WAKE_UP_TAGS,
    PhaseClock,
    release_weights,
    restore_weights,
)

if TYPE_CHECKING:
    from engine_core.engine_core import EngineCore

logger = logging.getLogger("pdserve.engine")


class SleepMode:
    """``EngineCore``'s sleep and wake-up."""

    @property
    def sleep_level(self: EngineCore) -> int:
        """0 awake, else the level the engine sleeps at (until weights and KV cache are
        both back)."""
        return self._sleep_level

    def sleep(self: EngineCore, level: int = 1) -> dict[str, float]:
        """Give back the device memory of the weights (level 1: a host copy is kept; level
        2: not) and of the KV cache (its contents are dropped: the prefix cache is reset).
        The CUDA graphs are kept: waking restores both at the same addresses. Only an idle
        engine sleeps; asleep, it refuses requests until ``wake_up``. Sleeping again is a
        no-op. Returns the seconds of each phase."""
        if not self.config.model.enable_sleep_mode:
            raise InvalidRequestError("sleep mode is off: start the engine with "
                                      "--enable-sleep-mode")
        if level not in SLEEP_LEVELS:
            raise InvalidRequestError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}",
                                      "level")
        if self._sleep_level:
            return {}
        if self.has_work() or self.has_transfer_state():
            raise InvalidRequestError("the engine has requests or KV transfers in flight; "
                                      "sleep when it is idle")
        assert self.weights_arena is not None and self.kv_arena is not None
        clock = PhaseClock()
        free_before = self._free_device_bytes()
        if self.host_kv is not None:
            # Host memory keeps its blocks: valid after a level-1 wake-up (the same weights);
            # a level-2 wake-up reloads the weights and drops them.
            self.host_kv.drain()
        self.kv_manager.reset_prefix_cache(keep_host=True)
        self.connector_worker.release_kv_caches()
        self.kv_arena.release()
        self._kv_asleep = True
        self._sleep_level = level
        clock.lap("kv_cache_s")
        self._asleep = release_weights(self.weights_arena, level, self._host_weights)
        self._host_weights = self._asleep.host or self._host_weights
        clock.lap("weights_s")
        freed = (self._free_device_bytes() - free_before) / 2**30
        logger.info("Sleep level %d took %.2f s (%s): %.2f GiB of device memory freed, "
                    "%.2f GiB of weights kept in host memory", level, clock.total,
                    clock.summary(), freed, self._asleep.host_bytes / 2**30)
        return clock.phases

    def wake_up(self: EngineCore, tags: Sequence[str] | None = None) -> dict[str, float]:
        """Weights (host copy, or reloaded) and an empty KV cache back at their addresses;
        the CUDA graphs replay as they were. ``tags`` (vLLM's): wake only ``weights`` or only
        ``kv_cache`` (e.g. the weights first, to update them with the cache's memory still
        free); None wakes both. The engine serves again once both are back. Waking what is
        awake is a no-op. Returns the seconds of each phase."""
        wanted = set(WAKE_UP_TAGS if tags is None else tags)
        if not wanted or not wanted <= set(WAKE_UP_TAGS):
            raise InvalidRequestError(f"wake_up tags must be among {list(WAKE_UP_TAGS)}, "
                                      f"got {sorted(wanted)}", "tags")
        clock = PhaseClock()
        if "weights" in wanted and self._asleep is not None:
            assert self.weights_arena is not None
            restore_weights(self.weights_arena, self._asleep,
                            lambda: load_weights(self.model, self.config.model, self.spec))
            self._asleep = None
            if self._sleep_level == 2 and self.kv_manager.host_tier is not None:
                # Level 2 reloads the checkpoint, which may have changed meanwhile (vLLM's
                # weight-update level): KV in host memory was computed with the old weights,
                # and served it as prefix hits. Level 1 restores the same bytes and keeps it.
                self.kv_manager.host_tier.clear()
            clock.lap("weights_s")
        if "kv_cache" in wanted and self._kv_asleep:
            assert self.kv_arena is not None
            self.kv_arena.restore()
            self.kv_arena.tensor.zero_()
            self.connector_worker.register_kv_caches(self.kv_caches)
            if self.kv_arena.device.type == "cuda":
                torch.cuda.synchronize(self.kv_arena.device)
            self._kv_asleep = False
            clock.lap("kv_cache_s")
        if self._sleep_level and self._asleep is None and not self._kv_asleep:
            self._sleep_level = 0
        if clock.phases:
            logger.info("Wake-up (%s) took %.2f s (%s)", ", ".join(sorted(wanted)),
                        clock.total, clock.summary())
        return clock.phases

    def _free_device_bytes(self: EngineCore) -> int:
        """Free memory on this engine's GPU (0 on CPU): arenas are outside PyTorch's counts."""
        device = torch.device(self.device)
        if device.type != "cuda":
            return 0
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
