"""Engine speed against limits measured in the same run (issue #6).

Every figure is a ratio to a limit this run measures on the same GPU:

- ``limits``: device copy bandwidth (a large device-to-device copy; read+write bytes/s,
  used as the roofline bandwidth for reads) and the bf16 matmul rate (8192^3 matmul).
- ``decode``: decode step time of Qwen3-8B shapes at batch x context cases (default 1x1024
  goal <= 1.10 x roofline, 64x2048 and 256x2048 goal <= 1.25 x), roofline = (weight bytes
  read + KV bytes read) / copy bandwidth.
- ``mixed``: steps that mix a decoding batch with one new short prompt (what serving with
  steady arrivals runs), against the same batch's decode-only step in the same engine; no
  goal. ``--cuda-graph-mode full_decode_only`` runs them eagerly (the A/B of mixed-step
  graphs); ``--hooked-connector`` gives the engine a stand-in connector whose every step
  needs layer hooks (a prefill worker's sends, minus the sends); a batch of 0 makes every
  step a prefill of the arriving prompt.
- ``prefill``: one 2k and one 8k prompt, timed from the first step to the first token (with
  async scheduling that includes one more, empty, step); achieved FLOP/s (matmuls + causal
  attention) over the matmul rate, goal >= 60%.
- ``small``: Qwen3-0.6B decode at batch 1 with CUDA graphs and with --enforce-eager, goal
  < 1.5 ms a step.
- ``e2e``: offline throughput, 1000 prompts of 512 random tokens, 128 output tokens each
  (ignore_eos), Qwen3-8B shapes; ``hf``: HF transformers on the same GPU with a randomly
  initialised model of the same config, on the first ``--hf-prompts`` of the same prompts
  (``generate_batch``, else padded ``generate``); goal >= 5x output tokens/s, compared on
  the same prompt subset.

Steps are driven through ``EngineCore.step()`` (scheduler + runner + sampler), timed on the
host; each step's model forward (graph replay or eager) is also timed with CUDA events, so
the host's share of a step is visible. Weights are ``--load-format dummy`` in bfloat16.

    python3 -m benchmarks.engine_speed --out /tmp/engine_speed.json
    python3 -m benchmarks.engine_speed --only decode,small --decode-cases 1x1024,64x2048
    python3 -m benchmarks.engine_speed --smoke --out /tmp/smoke.json   # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import write_model_dir
from engine_core.arg_utils import engine_environment
from engine_core.config import (
    SPLIT_K_MLP_MODES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine_core.engine_core import EngineCore
from engine_core.kv_connector import NullConnectorWorker
from engine_core.messages import AddRequest
from engine_core.models.spec import ModelSpec
from engine_core.sampling_params import SamplingParams
from engine_core.worker.forward_timer import ForwardTimer
from engine_core.worker.loader import read_model_spec

PARTS = ("limits", "decode", "mixed", "prefill", "small", "e2e", "hf")
# Tiny shapes for --smoke (CPU or GPU): every code path in seconds.
SMOKE_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=1024, max_position_embeddings=4096)

logger = logging.getLogger("pdserve.bench.engine_speed")


# ---- timing and limits ------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int,
            warmup: int = 3) -> list[float]:
    """Per-call times in ms (CUDA events on GPU, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "min": ordered[0], "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "n": len(ordered)}


def measure_limits(device: torch.device, copy_bytes: int, matmul_n: int,
                   iters: int) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes per second) and the bf16 matmul rate."""
    copy_times = _copy_times(device, copy_bytes, iters)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm_times = _matmul_times(device, matmul_n, dtype, iters)
    free_memory()
    copy_ms, mm_ms = statistics.median(copy_times), statistics.median(mm_times)
    return {
        "copy_bytes_each_way": copy_bytes,
        "copy_ms": stats_ms(copy_times),
        "copy_bandwidth_bytes_per_s": 2 * copy_bytes / (copy_ms / 1e3),
        "copy_bandwidth_best_bytes_per_s": 2 * copy_bytes / (min(copy_times) / 1e3),
        "matmul_n": matmul_n,
        "matmul_dtype": str(dtype),
        "matmul_ms": stats_ms(mm_times),
        "matmul_flops_per_s": 2 * matmul_n ** 3 / (mm_ms / 1e3),
        "matmul_best_flops_per_s": 2 * matmul_n ** 3 / (min(mm_times) / 1e3),
    }


def _copy_times(device: torch.device, nbytes: int, iters: int) -> list[float]:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device, iters)


def _matmul_times(device: torch.device, n: int, dtype: torch.dtype, iters: int) -> list[float]:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return time_ms(lambda: torch.matmul(a, b), device, iters)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- model arithmetic -------------------------------------------------------------------


def weight_bytes_read(model: torch.nn.Module, spec: ModelSpec) -> int:
    """Parameter bytes a decode step reads: all of them, except an untied input embedding
    (only the batch's rows are gathered)."""
    total = 0
    for name, param in model.named_parameters():  # a tied lm_head appears once
        if name.endswith("embed_tokens.weight") and not spec.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(spec: ModelSpec, element_size: int) -> int:
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * element_size


def decoder_matmul_params(spec: ModelSpec) -> int:
    """Weights of the per-token matmuls of the decoder layers (q, k, v, o, gate, up, down)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return spec.num_hidden_layers * per_layer


def prefill_flops(spec: ModelSpec, num_tokens: int) -> dict[str, float]:
    """FLOPs of one prefill of ``num_tokens`` (logits of the last token only)."""
    matmul = 2.0 * num_tokens * decoder_matmul_params(spec) + 2.0 * spec.hidden_size * spec.vocab_size
    # Causal: query i sees i + 1 keys; QK^T and PV are 2 * head_dim FLOPs per (query, key, head).
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 2 * 2.0 * spec.num_attention_heads * spec.head_dim * pairs * spec.num_hidden_layers
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


# ---- driving an engine ------------------------------------------------------------------


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


class HookedStandIn(NullConnectorWorker):
    """A connector whose every step needs layer hooks that do nothing: a prefill worker's
    step shape (hooks decide whether a step may replay a graph) without the transfers."""

    def needs_layer_hooks(self, metadata: object) -> bool:
        return True


def build_engine(model_dir: Path, bench: BenchConfig, enforce_eager: bool = False
                 ) -> tuple[EngineCore, float]:
    environment = engine_environment(os.environ)  # PDSERVE_TRITON_PDL=0 for a PDL A/B
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=bench.dtype, load_format="dummy",
                          max_model_len=bench.max_model_len),
        cache=CacheConfig(gpu_memory_utilization=bench.gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=bench.max_num_seqs,
                                  max_num_batched_tokens=bench.max_num_batched_tokens,
                                  async_scheduling=bench.async_scheduling),
        device=DeviceConfig(device=bench.device, enforce_eager=enforce_eager,
                            triton_gemv_max_rows=bench.triton_gemv_max_rows,
                            split_k_mlp=bench.split_k_mlp,
                            cuda_graph_mode=bench.cuda_graph_mode,
                            triton_pdl=environment["triton_pdl"]),
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


def decode_case(driver: Driver, batch: int, context: int, steps: int, warmup: int,
                weight_bytes: int, kv_token_bytes: int, bandwidth: float | None) -> dict[str, Any]:
    engine = driver.engine
    budget = engine.config.scheduler.max_num_batched_tokens
    # Requests prefilled first decode while the rest prefill: none may finish before the end.
    prefill_steps_bound = 2 * (batch * context // budget + 2)
    new_tokens = warmup + steps + 2 + prefill_steps_bound
    block_size = engine.config.cache.block_size
    need = batch * -(-(context + new_tokens) // block_size)
    result: dict[str, Any] = {"batch": batch, "context": context, "timed_steps": steps}
    if need > engine.num_blocks or batch > engine.config.scheduler.max_num_seqs:
        result["skipped"] = (f"needs {need} KV blocks and {batch} sequences; the engine has "
                             f"{engine.num_blocks} blocks, max_num_seqs "
                             f"{engine.config.scheduler.max_num_seqs}")
        return result
    ids, prefill_steps = driver.start_decoding(batch, context, new_tokens, prefill_steps_bound)
    driver.timed_steps(warmup)
    # A decode step attends to every token of its request, the new one included.
    attended_at_start = sum(r.num_tokens_with_pending for r in engine.scheduler.running)
    step_ms, samples = driver.timed_steps(steps)
    driver.drain(ids)
    forward_ms = [s.ms for s in samples]
    attended = attended_at_start + batch * (steps - 1) / 2  # mean over the timed steps
    kv_bytes = attended * kv_token_bytes
    result.update({
        "mean_context": attended / batch,
        "prefill_steps": prefill_steps,
        "step_ms": stats_ms(step_ms),
        "forward_ms": stats_ms(forward_ms),
        "host_ms_median": statistics.median(step_ms) - statistics.median(forward_ms),
        "graphed_steps": sum(s.graphed for s in samples),
        "padded_batch": samples[-1].num_tokens if samples else None,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "tokens_per_s": batch / (statistics.median(step_ms) / 1e3),
        "raw_step_ms": step_ms,
        "raw_forward_ms": forward_ms,
    })
    if bandwidth:
        roofline_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
        result["roofline_ms"] = roofline_ms
        result["step_over_roofline"] = statistics.median(step_ms) / roofline_ms
        result["forward_over_roofline"] = statistics.median(forward_ms) / roofline_ms
    return result


def mixed_case(driver: Driver, batch: int, context: int, prompt_len: int, steps: int,
               warmup: int) -> dict[str, Any]:
    """``batch`` sequences decoding while, before every step, one prompt of ``prompt_len``
    tokens arrives (one output token, so it leaves after its prefill): each timed step is a
    mixed prefill + decode step. Timed like ``decode_case``; then as many decode-only steps
    of the same batch for comparison."""
    engine = driver.engine
    block_size = engine.config.cache.block_size
    budget = engine.config.scheduler.max_num_batched_tokens
    prefill_steps_bound = 2 * (batch * context // budget + 2)
    new_tokens = 2 * (warmup + steps) + 4 + prefill_steps_bound
    need = (batch * -(-(context + new_tokens) // block_size)
            + 2 * -(-(prompt_len + 1) // block_size))
    result: dict[str, Any] = {"batch": batch, "context": context, "prompt_len": prompt_len,
                              "timed_steps": steps}
    if (need > engine.num_blocks or batch + 1 > engine.config.scheduler.max_num_seqs
            or batch + prompt_len > budget):
        result["skipped"] = (f"needs {need} KV blocks, {batch + 1} sequences and "
                             f"{batch + prompt_len} tokens a step")
        return result
    ids, prefill_steps = driver.start_decoding(batch, context, new_tokens, prefill_steps_bound)

    def arrive() -> None:
        driver.add(driver.random_prompt(prompt_len), 1)

    driver.timed_steps(warmup, arrive)
    step_ms, samples = driver.timed_steps(steps, arrive)
    mixed = [s for s in samples if s.num_tokens > batch]  # the forwards that held a prompt
    while len(engine.scheduler.running) > batch or engine.scheduler.waiting:
        engine.step()  # the last prompts leave
    driver.timed_steps(warmup)
    decode_ms, decode_samples = driver.timed_steps(steps)
    driver.drain(ids)
    result.update({
        "prefill_steps": prefill_steps,
        "step_ms": stats_ms(step_ms),
        "forward_ms": stats_ms([s.ms for s in mixed]) if mixed else None,
        "mixed_forwards": len(mixed),
        "graphed_steps": sum(s.graphed for s in samples),
        "decode_only_step_ms": stats_ms(decode_ms),
        "decode_only_graphed_steps": sum(s.graphed for s in decode_samples),
        "raw_step_ms": step_ms,
        "raw_decode_only_step_ms": decode_ms,
    })
    return result


def prefill_case(driver: Driver, length: int, reps: int, spec: ModelSpec,
                 matmul_rate: float | None) -> dict[str, Any]:
    engine = driver.engine
    result: dict[str, Any] = {"tokens": length, "reps": reps}
    if length >= engine.max_model_len or length > engine.config.scheduler.max_num_batched_tokens:
        result["skipped"] = (f"needs max_model_len > {length} and max_num_batched_tokens >= "
                             f"{length}")
        return result
    step_ms: list[float] = []
    forward_ms: list[float] = []
    for rep in range(reps + 1):  # the first is a warm-up
        request_id = driver.add(driver.random_prompt(length), 1)
        elapsed, samples = driver.timed_first_output(request_id)
        driver.run_to_completion()
        if rep:
            step_ms.append(elapsed)
            forward_ms += [s.ms for s in samples]
    flops = prefill_flops(spec, length)
    result.update({"step_ms": stats_ms(step_ms), "forward_ms": stats_ms(forward_ms),
                   "flops": flops, "raw_step_ms": step_ms, "raw_forward_ms": forward_ms})
    step_s = statistics.median(step_ms) / 1e3
    result["achieved_flops_per_s"] = flops["total"] / step_s
    result["forward_flops_per_s"] = flops["total"] / (statistics.median(forward_ms) / 1e3)
    if matmul_rate:
        result["fraction_of_matmul_rate"] = result["achieved_flops_per_s"] / matmul_rate
        result["forward_fraction_of_matmul_rate"] = result["forward_flops_per_s"] / matmul_rate
    return result


def throughput_run(driver: Driver, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    for prompt in prompts:
        driver.add(prompt, output_len)
    steps, tokens = driver.run_to_completion()
    elapsed = time.perf_counter() - t0
    return {"prompts": len(prompts), "output_tokens": tokens, "steps": steps,
            "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "total_tokens_per_s": (tokens + sum(map(len, prompts))) / elapsed}


# ---- HF transformers baseline -------------------------------------------------------------


def hf_throughput(model_dir: Path, prompts: list[list[int]], output_len: int,
                  device: torch.device, dtype: torch.dtype, batch: int) -> dict[str, Any]:
    """HF generation of ``prompts`` with a randomly initialised model of the same config."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    result: dict[str, Any] = {"transformers": transformers.__version__,
                              "prompts": len(prompts)}
    config = AutoConfig.from_pretrained(str(model_dir))
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa")
    model.eval()
    result["build_s"] = time.perf_counter() - t0
    generation = GenerationConfig(max_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    errors = []
    for options in ({}, {"auto_switch_to_flash": False}):
        try:
            result.update(_hf_generate_batch(model, prompts, generation, options))
            break
        except Exception as exc:  # an API difference or a failure: next try, and say so
            errors.append(f"{options}: {type(exc).__name__}: {exc}")
            logger.warning("HF generate_batch %s failed: %s", options, exc)
            if hasattr(model, "destroy_cached_continuous_batching_manager"):
                model.destroy_cached_continuous_batching_manager()
            free_memory()
    else:
        result.update(_hf_padded_generate(model, prompts, generation, device, batch))
    if errors:
        result["generate_batch_errors"] = errors
    del model
    free_memory()
    return result


def _cb_config(options: dict[str, Any]) -> Any:
    """A ContinuousBatchingConfig with the options this transformers version knows, or None."""
    import dataclasses

    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        return None
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return ContinuousBatchingConfig(**{k: v for k, v in options.items() if k in known})


def _hf_generate_batch(model: Any, prompts: list[list[int]], generation: Any,
                       options: dict[str, Any]) -> dict[str, Any]:
    """Continuous batching: a warm-up call keeps its (warmed) manager for the timed call.

    The batch limit is what ``generate_batch`` would pick for the timed call itself (it
    sizes a manager from the first call's requests, here the warm-up's)."""
    cb_config = _cb_config({"max_requests_per_batch": len(prompts), **options})
    kwargs: dict[str, Any] = dict(generation_config=generation, progress_bar=False,
                                  persistent_manager=True)
    if cb_config is not None:
        kwargs["continuous_batching_config"] = cb_config
    t0 = time.perf_counter()
    model.generate_batch(prompts[:8], **kwargs)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = model.generate_batch(prompts, **kwargs)
    elapsed = time.perf_counter() - t0
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    lengths = [len(o.generated_tokens) for o in outputs.values()]
    errors = [o.error for o in outputs.values() if getattr(o, "error", None)]
    if len(outputs) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(outputs)} outputs, errors {errors[:3]}")
    tokens = sum(lengths)
    return {"method": "generate_batch", "options": options,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "warmup_s": warmup_s, "elapsed_s": elapsed,
            "output_tokens": tokens, "min_output_len": min(lengths),
            "output_tokens_per_s": tokens / elapsed}


def _hf_padded_generate(model: Any, prompts: list[list[int]], generation: Any,
                        device: torch.device, batch: int) -> dict[str, Any]:
    """Static batches through ``generate`` (left-padded; equal lengths need no padding)."""
    generation.min_new_tokens = generation.max_new_tokens

    def run(chunk: list[list[int]]) -> int:
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(chunk):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 generation_config=generation)
        return int(out.shape[0] * (out.shape[1] - width))

    t0 = time.perf_counter()
    run(prompts[:min(batch, 4)])
    warmup_s = time.perf_counter() - t0
    sync(device)
    t0 = time.perf_counter()
    tokens = sum(run(prompts[i:i + batch]) for i in range(0, len(prompts), batch))
    sync(device)
    elapsed = time.perf_counter() - t0
    return {"method": f"generate (static batches of {batch})", "warmup_s": warmup_s,
            "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed}


# ---- the parts ----------------------------------------------------------------------------


class Bench:
    """Runs the selected parts, keeping every result (and every error) for the JSON."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.results: dict[str, Any] = {"errors": {}}
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-engine-speed-"))
        overrides = SMOKE_OVERRIDES if args.smoke else {}
        self.big_dir = write_model_dir(args.model, self.workdir / args.model, **overrides)
        self.small_dir = write_model_dir(args.small_model, self.workdir / args.small_model,
                                         **overrides)
        self.vocab_size = read_model_spec(self.big_dir).vocab_size

    def bench_config(self, max_num_seqs: int | None = None) -> BenchConfig:
        a = self.args
        return BenchConfig(device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
                           max_num_seqs=max_num_seqs or a.max_num_seqs,
                           max_num_batched_tokens=a.max_num_batched_tokens,
                           gpu_memory_utilization=a.gpu_memory_utilization,
                           triton_gemv_max_rows=a.triton_gemv_max_rows,
                           split_k_mlp=a.split_k_mlp,
                           async_scheduling=a.async_scheduling,
                           cuda_graph_mode=a.cuda_graph_mode)

    def guarded(self, name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception:
            self.results["errors"][name] = traceback.format_exc()
            logger.error("part %s failed:\n%s", name, self.results["errors"][name])
        finally:
            free_memory()
        self.results.setdefault("part_seconds", {})[name] = time.perf_counter() - t0

    @property
    def bandwidth(self) -> float | None:
        return self.results.get("limits", {}).get("copy_bandwidth_bytes_per_s")

    @property
    def matmul_rate(self) -> float | None:
        return self.results.get("limits", {}).get("matmul_flops_per_s")

    def limits(self) -> dict[str, Any]:
        a = self.args
        return measure_limits(self.device, a.copy_bytes, a.matmul_n, a.limit_iters)

    def big_engine_parts(self, parts: set[str]) -> None:
        """decode, prefill and e2e share one engine of the large model."""
        engine, startup = build_engine(self.big_dir, self.bench_config())
        if self.args.hooked_connector:
            engine.runner.connector = HookedStandIn()
        try:
            self.results["engine"] = engine_info(engine, startup)
            info = self.results["engine"]
            print(f"engine: split-K MLP {info['split_k_mlp']} "
                  f"({info['split_k_mlp_layers']} layers take it)", flush=True)
            driver = Driver(engine, self.args.seed)
            if "decode" in parts:
                self.guarded("decode", lambda: self.decode(driver))
            if "mixed" in parts:
                self.guarded("mixed", lambda: [
                    mixed_case(driver, batch, context, prompt, self.args.decode_steps,
                               self.args.warmup_steps)
                    for batch, context, prompt in self.args.mixed_cases])
            if "prefill" in parts:
                self.guarded("prefill", lambda: self.prefill(driver))
            if "e2e" in parts:
                self.guarded("e2e", lambda: self.e2e(driver))
        finally:
            engine.shutdown()  # its memory goes with this frame (the caller frees it)

    def decode(self, driver: Driver) -> list[dict[str, Any]]:
        a, engine = self.args, driver.engine
        weights = weight_bytes_read(engine.model, engine.spec)
        kv_token = kv_bytes_per_token(engine.spec, engine.kv_caches[0].element_size())
        out = []
        for batch, context in a.decode_cases:
            case = decode_case(driver, batch, context, a.decode_steps, a.warmup_steps,
                               weights, kv_token, self.bandwidth)
            case["goal_step_over_roofline"] = 1.10 if batch == 1 else 1.25
            if "step_over_roofline" in case:
                case["meets_goal"] = case["step_over_roofline"] <= case["goal_step_over_roofline"]
            out.append(case)
        return out

    def prefill(self, driver: Driver) -> list[dict[str, Any]]:
        out = []
        for length in self.args.prefill_lens:
            case = prefill_case(driver, length, self.args.prefill_reps, driver.engine.spec,
                                self.matmul_rate)
            case["goal_fraction_of_matmul_rate"] = 0.60
            if "fraction_of_matmul_rate" in case:
                case["meets_goal"] = case["fraction_of_matmul_rate"] >= 0.60
            out.append(case)
        return out

    def e2e_prompts(self) -> list[list[int]]:
        a = self.args
        top = min(self.vocab_size, 150000) - 1
        rng = random.Random(a.seed + 1)
        return [[rng.randint(10, top) for _ in range(a.e2e_input_len)]
                for _ in range(a.e2e_prompts)]

    def e2e(self, driver: Driver) -> dict[str, Any]:
        a = self.args
        prompts = self.e2e_prompts()
        warm = [driver.random_prompt(a.e2e_input_len) for _ in range(min(16, len(prompts)))]
        throughput_run(driver, warm, min(a.e2e_output_len, 16))  # compile, fill caches
        driver.engine.reset_prefix_cache()
        ours = throughput_run(driver, prompts, a.e2e_output_len)
        driver.engine.reset_prefix_cache()
        subset = throughput_run(driver, prompts[:a.hf_prompts], a.e2e_output_len)
        driver.engine.reset_prefix_cache()
        return {"input_len": a.e2e_input_len, "output_len": a.e2e_output_len,
                "ours": ours, "ours_on_hf_prompts": subset}

    def hf(self) -> dict[str, Any]:
        a = self.args
        prompts = self.e2e_prompts()[:a.hf_prompts]
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float16": torch.float16}[a.dtype]
        result = hf_throughput(self.big_dir, prompts, a.e2e_output_len, self.device, dtype,
                               a.hf_batch)
        result["note"] = (f"HF ran the first {len(prompts)} of the {a.e2e_prompts} prompts "
                          "(its speed limits the run time); the ratio compares both engines "
                          "on that same subset")
        return result

    def small(self) -> list[dict[str, Any]]:
        out = []
        for eager in (False, True):
            out.append(self._small_case(eager))
            free_memory()  # the engine is gone with the call's frame
        return out

    def _small_case(self, eager: bool) -> dict[str, Any]:
        a = self.args
        engine, startup = build_engine(self.small_dir, self.bench_config(), eager)
        try:
            driver = Driver(engine, a.seed)
            weights = weight_bytes_read(engine.model, engine.spec)
            kv_token = kv_bytes_per_token(engine.spec, engine.kv_caches[0].element_size())
            case = decode_case(driver, 1, a.small_context, a.small_steps, a.warmup_steps,
                               weights, kv_token, self.bandwidth)
        finally:
            engine.shutdown()
        case.update({"enforce_eager": eager, "engine": engine_info(engine, startup),
                     "goal_step_ms": 1.5})
        if "step_ms" in case:
            case["meets_goal"] = case["step_ms"]["median"] < 1.5
        return case

    def run(self) -> dict[str, Any]:
        a = self.args
        parts = set(a.only)
        t0 = time.perf_counter()
        self.results["meta"] = meta(a)
        if "limits" in parts or parts & {"decode", "prefill", "small"}:
            self.guarded("limits", self.limits)
        if parts & {"decode", "mixed", "prefill", "e2e"}:
            self.guarded("big_engine", lambda: self.big_engine_parts(parts))
            if self.device.type == "cuda":  # a leak here would shrink every later engine
                self.results["cuda_bytes_after_big_engine"] = torch.cuda.memory_allocated()
        if "hf" in parts:
            self.guarded("hf", self.hf)
        if "small" in parts:
            self.guarded("small", self.small)
        e2e, hf = self.results.get("e2e"), self.results.get("hf")
        if e2e and hf and hf.get("output_tokens_per_s"):
            ratio = e2e["ours_on_hf_prompts"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
            self.results["e2e_vs_hf"] = {"ratio_output_tokens_per_s": ratio, "goal": 5.0,
                                         "meets_goal": ratio >= 5.0}
        self.results["total_s"] = time.perf_counter() - t0
        self.results.pop("big_engine", None)
        return self.results


def meta(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"},
                            "torch": torch.__version__, "python": platform.python_version(),
                            "started_unix": time.time()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


# ---- summary ------------------------------------------------------------------------------


def summarize(results: dict[str, Any]) -> str:
    lines = []
    limits = results.get("limits")
    if limits:
        lines.append(f"limits: copy {limits['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s "
                     f"(read+write), matmul {limits['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    engine = results.get("engine")
    if engine:
        lines.append(f"engine: startup {engine['startup_s']:.1f} s, {engine['num_kv_blocks']} "
                     f"KV blocks, {engine['cuda_graph_count']} graphs captured in "
                     f"{engine['cuda_graph_capture_s']:.1f} s "
                     f"({engine['cuda_graph_pool_bytes'] / 2**20:.0f} MiB)")
    for case in results.get("decode", []):
        lines.append(_decode_line("decode", case))
    for case in results.get("mixed", []):
        head = f"mixed b{case['batch']} ctx{case['context']} + {case['prompt_len']}-token prompt"
        if "skipped" in case:
            lines.append(f"{head}: skipped ({case['skipped']})")
            continue
        forward = case["forward_ms"]["median"] if case["forward_ms"] else float("nan")
        lines.append(f"{head}: step {case['step_ms']['median']:.3f} ms (forward {forward:.3f}, "
                     f"graphed {case['graphed_steps']}/{case['timed_steps']}); the batch's "
                     f"decode-only step {case['decode_only_step_ms']['median']:.3f} ms "
                     f"(graphed {case['decode_only_graphed_steps']}/{case['timed_steps']})")
    for case in results.get("prefill", []):
        if "skipped" in case:
            lines.append(f"prefill {case['tokens']}: skipped ({case['skipped']})")
            continue
        frac = case.get("fraction_of_matmul_rate")
        lines.append(
            f"prefill {case['tokens']:>5}: step {case['step_ms']['median']:.1f} ms, forward "
            f"{case['forward_ms']['median']:.1f} ms, {case['achieved_flops_per_s'] / 1e12:.0f} "
            f"TFLOP/s" + (f" = {frac:.0%} of matmul (goal >= 60%)" if frac else ""))
    for case in results.get("small", []):
        lines.append(_decode_line("small " + ("eager " if case["enforce_eager"] else "graphs"),
                                  case) + " (goal < 1.5 ms)")
    e2e, hf = results.get("e2e"), results.get("hf")
    if e2e:
        ours = e2e["ours"]
        lines.append(f"e2e ours: {ours['prompts']} prompts, {ours['output_tokens_per_s']:.0f} "
                     f"out tok/s ({ours['elapsed_s']:.1f} s); on the HF subset "
                     f"{e2e['ours_on_hf_prompts']['output_tokens_per_s']:.0f} out tok/s")
    if hf and "output_tokens_per_s" in hf:
        lines.append(f"e2e HF ({hf['method']}): {hf['prompts']} prompts, "
                     f"{hf['output_tokens_per_s']:.0f} out tok/s ({hf['elapsed_s']:.1f} s)")
    versus = results.get("e2e_vs_hf")
    if versus:
        lines.append(f"e2e ratio ours/HF: {versus['ratio_output_tokens_per_s']:.1f}x "
                     f"(goal >= 5x)")
    for name, error in results.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {error.strip().splitlines()[-1]}")
    lines.append(f"total {results.get('total_s', 0):.0f} s")
    return "\n".join(lines)


def _decode_line(label: str, case: dict[str, Any]) -> str:
    head = f"{label} b{case['batch']} ctx{case['context']}"
    if "skipped" in case:
        return f"{head}: skipped ({case['skipped']})"
    line = (f"{head}: step {case['step_ms']['median']:.3f} ms, forward "
            f"{case['forward_ms']['median']:.3f} ms, host {case['host_ms_median']:.3f} ms, "
            f"graphed {case['graphed_steps']}/{case['timed_steps']}")
    if "roofline_ms" in case:
        line += (f", roofline {case['roofline_ms']:.3f} ms -> {case['step_over_roofline']:.2f}x"
                 f" (forward {case['forward_over_roofline']:.2f}x)")
    if "goal_step_over_roofline" in case and "roofline_ms" in case:
        line += f" (goal <= {case['goal_step_over_roofline']:.2f}x)"
    return line


# ---- command line -------------------------------------------------------------------------


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        batch, context = item.lower().split("x")
        cases.append((int(batch), int(context)))
    return cases


def parse_mixed_cases(text: str) -> list[tuple[int, int, int]]:
    cases = []
    for item in text.split(","):
        batch, context, prompt = item.lower().split("x")
        cases.append((int(batch), int(context), int(prompt)))
    return cases


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="raw results JSON")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts among {','.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and sizes (checks every path in seconds, any device)")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    parser.add_argument("--model", default="qwen3-8b", help="shape of decode/prefill/e2e/hf")
    parser.add_argument("--small-model", default="qwen3-0.6b", help="shape of the small part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=10240)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--triton-gemv-max-rows", type=int, default=None,
                        help="the engine flag (default: the engine's default)")
    parser.add_argument("--split-k-mlp", choices=SPLIT_K_MLP_MODES, default="auto",
                        help="the engine flag (default: auto, as in pdserve)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True, help="the engine flag (default on, as in pdserve)")
    parser.add_argument("--cuda-graph-mode", default="full",
                        help="the engine flag (full_decode_only: mixed steps run eagerly)")
    parser.add_argument("--hooked-connector", action="store_true",
                        help="the large engine's steps all need connector layer hooks (no-op)")
    parser.add_argument("--copy-bytes", type=int, default=2 << 30, help="each way")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--limit-iters", type=int, default=20)
    parser.add_argument("--decode-cases", type=parse_cases,
                        default=parse_cases("1x1024,64x2048,256x2048"),
                        help="batch x context, comma-separated")
    parser.add_argument("--decode-steps", type=int, default=50, help="timed steps per case")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--mixed-cases", type=parse_mixed_cases,
                        default=parse_mixed_cases("1x1024x64,16x1024x64,64x1024x64"),
                        help="batch x context x new prompt tokens, comma-separated")
    parser.add_argument("--prefill-lens", type=parse_ints, default=parse_ints("2048,8192"))
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--small-context", type=int, default=1024)
    parser.add_argument("--small-steps", type=int, default=200)
    parser.add_argument("--e2e-prompts", type=int, default=1000)
    parser.add_argument("--e2e-input-len", type=int, default=512)
    parser.add_argument("--e2e-output-len", type=int, default=128)
    parser.add_argument("--hf-prompts", type=int, default=300,
                        help="prompts HF generates (the first ones of the e2e set)")
    parser.add_argument("--hf-batch", type=int, default=64,
                        help="static batch of the padded-generate fallback")
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose among {PARTS}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "float32" if args.smoke else "bfloat16"
    if args.smoke:
        args.max_model_len = 1024
        args.max_num_seqs = 16
        args.max_num_batched_tokens = 512
        args.copy_bytes = 64 << 20
        args.matmul_n = 512
        args.limit_iters = 5
        args.decode_cases = [(1, 64), (8, 128)]
        args.mixed_cases = [(4, 64, 16)]
        args.decode_steps = 5
        args.warmup_steps = 2
        args.prefill_lens = [128, 512]
        args.prefill_reps = 1
        args.small_context = 64
        args.small_steps = 5
        args.e2e_prompts = 24
        args.e2e_input_len = 32
        args.e2e_output_len = 8
        args.hf_prompts = 8
        args.hf_batch = 4
    args.hf_prompts = min(args.hf_prompts, args.e2e_prompts)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # HF's continuous batching logs every session at INFO; keep its warnings only.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.WARNING)
    args = parse_args(argv)
    results = Bench(args).run()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(summarize(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
