"""Builds an engine of dummy weights and drives it step by step through ``EngineCore.step()``."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine_core.engine_core import EngineCore
from engine_core.kv_connector import NullConnectorWorker
from engine_core.messages import AddRequest
from engine_core.sampling_params import SamplingParams
from engine_core.worker.forward_timer import ForwardTimer

# Tiny shapes for --smoke (CPU or GPU): every code path in seconds.
SMOKE_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=1024, max_position_embeddings=4096)


@dataclass
class BenchConfig:
    device: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    triton_gemv_max_rows: int | None = None
    split_k_mlp: str = "auto"
    async_scheduling: bool = True
    cuda_graph_mode: str = "full"
    triton_pdl: bool = True
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    decode_step_target_s: float | None = None


class HookedStandIn(NullConnectorWorker):
    """A connector whose every step needs layer hooks that do nothing: a prefill worker's
    step shape (hooks decide whether a step may replay a graph) without the transfers."""

    def needs_layer_hooks(self, metadata: object) -> bool:
        return True


def build_engine(model_dir: Path, bench: BenchConfig, enforce_eager: bool = False
                 ) -> tuple[EngineCore, float]:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=bench.dtype, load_format="dummy",
                          max_model_len=bench.max_model_len),
        cache=CacheConfig(gpu_memory_utilization=bench.gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=bench.max_num_seqs,
                                  max_num_batched_tokens=bench.max_num_batched_tokens,
                                  async_scheduling=bench.async_scheduling,
                                  decode_step_target_s=bench.decode_step_target_s),
        device=DeviceConfig(device=bench.device, enforce_eager=enforce_eager,
                            triton_gemv_max_rows=bench.triton_gemv_max_rows,
                            split_k_mlp=bench.split_k_mlp,
                            cuda_graph_mode=bench.cuda_graph_mode,
                            triton_pdl=bench.triton_pdl),
        parallel=ParallelConfig(tensor_parallel_size=bench.tensor_parallel_size,
                                disable_custom_all_reduce=bench.disable_custom_all_reduce),
    )
    t0 = time.perf_counter()
    engine = EngineCore(config)
    return engine, time.perf_counter() - t0


def engine_info(engine: EngineCore, startup_s: float) -> dict[str, Any]:
    capture = engine.graph_capture
    return {
        "startup_s": startup_s,
        "attention_backend": engine.attn_backend.name,
        "dtype": str(engine.dtype),
        "num_kv_blocks": engine.num_blocks,
        "block_size": engine.config.cache.block_size,
        "cuda_graph_sizes": capture.sizes.decode if capture else [],
        "cuda_graph_mixed_sizes": capture.sizes.mixed if capture else [],
        "cuda_graph_count": capture.count if capture else 0,
        "cuda_graph_mode": engine.config.device.cuda_graph_mode,
        "cuda_graph_capture_s": capture.seconds if capture else 0.0,
        "cuda_graph_pool_bytes": capture.pool_bytes if capture else 0,
        "cuda_graph_pool_reserved_bytes": engine.graph_pool_reserve,
        "enforce_eager": engine.config.device.enforce_eager,
        "gemv_max_rows": engine.attn_backend.gemv_max_rows,
        "split_k_mlp": engine.attn_backend.split_k_mlp,
        # Layers whose MLP runs split-K (the flag's auto may leave them all off).
        "split_k_mlp_layers": sum(bool(getattr(module, "split_k", False))
                                  for module in engine.model.modules()),
        "async_scheduling": engine.async_scheduling,
    }


class Driver:
    """Adds requests to an EngineCore and steps it, with optional forward timing."""

    def __init__(self, engine: EngineCore, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self._ids = itertools.count()

    def random_prompt(self, length: int) -> list[int]:
        # Random ids: no two prompts share a block, so nothing hits the prefix cache.
        top = min(self.engine.vocab_size, 150000) - 1
        return [self.rng.randint(10, top) for _ in range(length)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"bench-{next(self._ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(AddRequest(request_id, prompt, params.to_dict(),
                                           time.monotonic()))
        return request_id

    def all_decoding(self, count: int) -> bool:
        sched = self.engine.scheduler
        return (not sched.waiting and len(sched.running) == count
                and all(r.num_tokens_with_pending - r.num_computed_tokens == 1
                        for r in sched.running))

    def start_decoding(self, batch: int, context: int, max_tokens: int, max_steps: int
                       ) -> tuple[list[str], int]:
        """Add ``batch`` random prompts of ``context`` tokens and step until every one is
        decoding; (their ids, the steps it took)."""
        ids = [self.add(self.random_prompt(context), max_tokens) for _ in range(batch)]
        steps = 0
        while not self.all_decoding(batch):
            self.engine.step()
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"{batch} x {context}: the batch never reached pure decode")
        return ids, steps

    def run_to_completion(self) -> tuple[int, int]:
        """Step until idle; (steps, output tokens)."""
        steps = tokens = 0
        while self.engine.has_work():
            for out in self.engine.step():
                tokens += len(out.new_token_ids)
            steps += 1
        return steps, tokens

    @contextlib.contextmanager
    def _forward_timer(self) -> Iterator[ForwardTimer]:
        """Time every forward the runner runs inside the block."""
        timer = ForwardTimer(torch.device(self.engine.device))
        self.engine.runner.forward_timer = timer
        try:
            yield timer
        finally:
            self.engine.runner.forward_timer = None

    def timed_steps(self, count: int, before_each: Callable[[], object] | None = None
                    ) -> tuple[list[float], list[Any]]:
        """Host wall time of each of ``count`` ``step()`` calls (in steady state, with async
        scheduling, one launch plus the previous step's collect), and their forwards;
        ``before_each`` runs untimed before every step (a request arriving)."""
        times = []
        with self._forward_timer() as timer:
            for _ in range(count):
                if before_each is not None:
                    before_each()
                t0 = time.perf_counter()
                self.engine.step()
                times.append((time.perf_counter() - t0) * 1e3)
        return times, timer.collect()

    def timed_first_output(self, request_id: str) -> tuple[float, list[Any]]:
        """Host wall time from the first step until ``request_id``'s first token is out
        (with async scheduling a step's tokens come out of the next ``step()`` call), and
        the forward samples of those steps."""
        with self._forward_timer() as timer:
            t0 = time.perf_counter()
            while not any(out.request_id == request_id and out.new_token_ids
                          for out in self.engine.step()):
                pass
            elapsed = (time.perf_counter() - t0) * 1e3
        return elapsed, timer.collect()

    def drain(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)
        while self.engine.has_work():
            self.engine.step()
