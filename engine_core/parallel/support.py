"""What tensor parallelism covers: one rule, checked by the engine and by the P/D worker
wiring before anything starts."""

from __future__ import annotations

from engine_core.config import EngineConfig
from engine_core.errors import ConfigError


def check_parallel_support(config: EngineConfig) -> None:
    """Raise ``ConfigError`` for a tensor-parallel config that is not supported: sleep mode
    (every rank's arenas would have to sleep and wake in lockstep)."""
    size = config.parallel.tensor_parallel_size
    if size > 1 and config.model.enable_sleep_mode:
        raise ConfigError(f"--enable-sleep-mode with --tensor-parallel-size {size} is not "
                          "supported yet")
