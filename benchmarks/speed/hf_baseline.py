"""HF transformers' throughput on the same prompts: the baseline of the ``e2e`` part."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.speed.limits import free_memory, sync

logger = logging.getLogger("pdserve.bench.engine_speed")


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
