"""What tensor parallelism covers: one rule, checked by the engine and by the P/D worker
wiring before anything starts."""

from __future__ import annotations

from engine_core.config import EngineConfig
from engine_core.errors import ConfigError


def check_parallel_support(config: EngineConfig, with_connector: bool = False) -> None:
    """Raise ``ConfigError`` for a tensor-parallel config that is not supported yet: KV
    transfer (prefill/decode workers) and sleep mode."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return
    if with_connector or config.kv_transfer is not None:
        raise ConfigError(f"--tensor-parallel-size {size} with a KV connector: KV transfer "
                          "between tensor-parallel layouts is not supported yet; run "
                          "prefill and decode workers with --tensor-parallel-size 1")
    if config.model.enable_sleep_mode:
        raise ConfigError(f"--enable-sleep-mode with --tensor-parallel-size {size} is not "
                          "supported yet")
