"""KV offload and sleep mode, measured in one go: what a prefix costs from each tier, and what
sleeping gives back and costs to undo.

    source .device/env.sh && python3 -m benchmarks.offload_sleep --out f.json    # Qwen3-8B dummy, bf16
    python3 -m benchmarks.offload_sleep --smoke --out /tmp/f.json                # demo model, CPU

Prefix reuse: one prompt of ``--prompt-len`` tokens (one output token each time), timed to its
end through the offline ``LLM``: recomputed from nothing, then again with its blocks cached on
the device, then after other prompts have pushed its blocks out of a device cache sized at
``--device-cache-prompts`` prompts into host memory (``--kv-offloading-size``), and once more
with KV offload off (recomputed: the baseline the host tier must beat). Sleep: device memory
in use (the whole GPU's) awake and asleep for level 1 (twice: the first sleep makes the pinned
host copy, the next reuses it) and level 2, the time of each call and of its phases, and the
first request's time after waking. On CUDA also KV offload's copy kernel against the raw
pinned copy rate, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.output import default_out, write_json
from engine_core import LLM, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _device_used(device: str) -> int:
    """Bytes in use on the GPU (0 on CPU): sleep mode's arenas are outside PyTorch's counts."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _timed_ms(llm: LLM, prompts: list[list[int]]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, ONE_TOKEN)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _release_memory() -> None:
    """Free the last engine's device memory before the next one sizes its cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 3) for _ in range(length)]


def prefix_reuse(model: str, engine: dict[str, Any], args: argparse.Namespace,
                 vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    block = engine.get("block_size", 16)
    blocks_per_prompt = -(-(args.prompt_len + 1) // block)
    # Room for this many prompts on the device: the others evict the measured one.
    device_blocks = blocks_per_prompt * args.device_cache_prompts
    prompt = _prompt(rng, args.prompt_len, vocab)
    others = [_prompt(rng, args.prompt_len, vocab) for _ in range(args.device_cache_prompts + 1)]
    out: dict[str, Any] = {"prompt_len": args.prompt_len, "device_blocks": device_blocks}
    for offload in (True, False):
        llm = LLM(model, **engine, num_gpu_blocks_override=device_blocks,
                  max_num_batched_tokens=max(args.prompt_len + 1, 512),
                  kv_offloading_size=args.kv_offloading_size if offload else 0.0)
        llm.generate([_prompt(rng, 64, vocab)], ONE_TOKEN)  # first-call costs out of the way
        runs: dict[str, float] = {}
        if offload:
            runs["recomputed_ms"] = _timed_ms(llm, [prompt])
            runs["device_hit_ms"] = _timed_ms(llm, [prompt])
        for other in others:
            llm.generate([other], ONE_TOKEN)
        tier = llm.engine.kv_manager.host_tier
        loaded = tier.loaded_blocks if tier is not None else 0
        key = "host_hit_ms" if offload else "recomputed_after_eviction_ms"
        runs[key] = _timed_ms(llm, [prompt])
        if tier is not None:
            runs["host_blocks_loaded"] = tier.loaded_blocks - loaded
        out["offload" if offload else "no_offload"] = runs
        del llm
        _release_memory()
    return out


def sleep_cycle(model: str, engine: dict[str, Any], device: str, vocab: int) -> dict[str, Any]:
    """Level 1 twice (the first sleep makes the pinned host copy, the second reuses it), then
    level 2; each with the engine's own phase times."""
    rng = random.Random(1)
    llm = LLM(model, **engine, enable_sleep_mode=True)
    probe = [_prompt(rng, 128, vocab)]
    llm.generate(probe, ONE_TOKEN)
    out: dict[str, Any] = {}
    for name, level in (("level_1_first", 1), ("level_1_again", 1), ("level_2", 2)):
        awake = _device_used(device)
        start = time.perf_counter()
        sleep_phases = llm.sleep(level)
        slept = time.perf_counter()
        asleep = _device_used(device)
        wake_phases = llm.wake_up()
        woken = time.perf_counter()
        out[name] = {
            "sleep_s": round(slept - start, 4), "wake_up_s": round(woken - slept, 4),
            "sleep_phases_s": sleep_phases, "wake_up_phases_s": wake_phases,
            "device_used_awake_gib": round(awake / 2**30, 3),
            "device_used_asleep_gib": round(asleep / 2**30, 3),
            "first_request_after_ms": round(_timed_ms(llm, probe), 2)}
    return out


def copy_rates(shape: str, blocks: int = 512) -> dict[str, Any]:
    """KV offload's copy kernel (random device blocks <-> random pinned host slots, every
    layer of a Qwen3 shape) against the raw contiguous copy of the same bytes between the
    same pinned memory and the device: the limit the kernel is held to."""
    from benchmarks.model_shapes import SHAPES
    from engine_core.worker.block_copy import copy_indexed_blocks
    from engine_core.worker.pinned_memory import HostBuffer

    cfg = SHAPES[shape]
    block_shape = (16, cfg["num_key_value_heads"], cfg["head_dim"])
    layers = cfg["num_hidden_layers"]
    cache = torch.zeros((layers, 2, 2 * blocks, *block_shape), dtype=torch.bfloat16,
                        device="cuda")
    slot_count = 2 * blocks
    memory = HostBuffer(cache.numel() * 2, pinned=True)
    store = memory.view(0, cache.shape, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(2 * blocks, generator=gen)[:blocks].cuda()
    slot_ids = torch.randperm(slot_count, generator=gen)[:blocks].cuda()
    nbytes = layers * 2 * blocks * cache[0, 0, 0].numel() * 2
    raw_host = memory.view(0, (nbytes // 2,), torch.bfloat16)
    raw_device = cache.view(-1)[:nbytes // 2]

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5

    runs = {
        "download_kernel": lambda: copy_indexed_blocks(cache, store, block_ids, slot_ids),
        "upload_kernel": lambda: copy_indexed_blocks(store, cache, slot_ids, block_ids),
        "raw_device_to_host": lambda: raw_host.copy_(raw_device, non_blocking=True),
        "raw_host_to_device": lambda: raw_device.copy_(raw_host, non_blocking=True),
    }
    out: dict[str, Any] = {"blocks": blocks, "bytes": nbytes}
    for name, fn in runs.items():
        seconds = timed(fn)
        out[f"{name}_ms"] = round(seconds * 1e3, 3)
        out[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
    out["download_of_raw"] = round(out["download_kernel_gbps"] / out["raw_device_to_host_gbps"], 3)
    out["upload_of_raw"] = round(out["upload_kernel_gbps"] / out["raw_host_to_device_gbps"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="demo model on CPU, tiny sizes")
    parser.add_argument("--shape", default="qwen3-8b", help="dummy-weight shape (GPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 8192 (smoke 64)")
    parser.add_argument("--device-cache-prompts", type=int, default=2,
                        help="device KV cache size, in prompts")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of host memory (default 16, smoke 0.01)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default results/offload_sleep/<time>.json)")
    args = parser.parse_args(argv)
    args.prompt_len = args.prompt_len or (64 if args.smoke else 8192)
    args.kv_offloading_size = args.kv_offloading_size or (0.01 if args.smoke else 16.0)
    if args.smoke:
        from engine_core.demo_model import DEMO_ARGS, random_demo_model_path

        model, device, vocab = str(random_demo_model_path()), "cpu", DEMO_ARGS.get("vocab_size", 1024)
        engine: dict[str, Any] = {"device": "cpu", "max_model_len": 512}
    else:
        from benchmarks.model_shapes import write_model_dir

        path = write_model_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
        model, device, vocab = str(path), "cuda", 151936
        engine = {"load_format": "dummy", "dtype": "bfloat16",
                  "max_model_len": args.prompt_len + 256}
    results = {"date": time.strftime("%Y-%m-%d"), "device": (torch.cuda.get_device_name()
                                                            if device == "cuda" else "cpu"),
               "args": vars(args),
               "prefix_reuse": prefix_reuse(model, engine, args, vocab),
               "sleep": sleep_cycle(model, engine, device, vocab)}
    if device == "cuda":
        results["copy_rates"] = copy_rates(args.shape)
    out = write_json(args.out or default_out("offload_sleep"), results)
    print(json.dumps(results, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
