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
import logging
import os
import platform
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import config_override, write_model_dir
from benchmarks.output import default_out, write_json
from benchmarks.speed.allreduce import measure_allreduce
from benchmarks.speed.cases import decode_case, mixed_case, prefill_case, throughput_run
from benchmarks.speed.driver import (
    SMOKE_OVERRIDES,
    BenchConfig,
    Driver,
    HookedStandIn,
    build_engine,
    engine_info,
)
from benchmarks.speed.hf_baseline import hf_throughput
from benchmarks.speed.limits import (
    free_memory,
    kv_bytes_per_token,
    measure_limits,
    weight_bytes_read,
)
from benchmarks.speed.summary import summarize
from engine_core.arg_utils import engine_environment
from engine_core.config import (
    SPLIT_K_MLP_MODES,
)
from engine_core.worker.loader import read_model_spec

PARTS = ("limits", "decode", "mixed", "prefill", "small", "e2e", "hf")

logger = logging.getLogger("pdserve.bench.engine_speed")


# ---- the parts ----------------------------------------------------------------------------


class Bench:
    """Runs the selected parts, keeping every result (and every error) for the JSON."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.results: dict[str, Any] = {"errors": {}}
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-engine-speed-"))
        overrides = SMOKE_OVERRIDES if args.smoke else {}
        self.big_dir = write_model_dir(args.model, self.workdir / args.model,
                                       **{**overrides, **dict(args.override)})
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
                           cuda_graph_mode=a.cuda_graph_mode,
                           triton_pdl=a.triton_pdl,
                           tensor_parallel_size=a.tensor_parallel_size,
                           disable_custom_all_reduce=a.disable_custom_all_reduce)

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
        """The group's matmul rate: one GPU's, times the tensor-parallel size."""
        rate = self.results.get("limits", {}).get("matmul_flops_per_s")
        return rate * self.args.tensor_parallel_size if rate else None

    def allreduce(self) -> dict[str, Any]:
        a = self.args
        hidden = read_model_spec(self.big_dir).hidden_size
        rows = sorted({batch for batch, _ in a.decode_cases})
        return measure_allreduce(a.tensor_parallel_size, rows, hidden,
                                 nccl_only=a.disable_custom_all_reduce)

    def allreduce_ms(self, layers: int, rows: int) -> float | None:
        """Two all-reduces per layer of a decode step of ``rows`` (graphed), or None."""
        measured = self.results.get("allreduce", {}).get("rows", {}).get(str(rows))
        return 2 * layers * measured["graphed_us"] / 1e3 if measured else None

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
        # Rank 0's shard and KV heads: every rank reads as much (the per-GPU roofline).
        weights = weight_bytes_read(engine.model, engine.spec)
        kv_token = kv_bytes_per_token(engine.rank_spec, engine.kv_caches[0].element_size())
        out = []
        for batch, context in a.decode_cases:
            case = decode_case(driver, batch, context, a.decode_steps, a.warmup_steps,
                               weights, kv_token, self.bandwidth)
            case["goal_step_over_roofline"] = 1.10 if batch == 1 else 1.25
            allreduce = self.allreduce_ms(engine.spec.num_hidden_layers, batch)
            if a.tensor_parallel_size > 1:
                case["goal_step_over_roofline"] = 1.15
                if allreduce is not None and "roofline_ms" in case:
                    case["allreduce_ms"] = allreduce
                    case["roofline_ms"] += allreduce
                    for kind in ("step", "forward"):
                        case[f"{kind}_over_roofline"] = (
                            statistics.median(case[f"raw_{kind}_ms"]) / case["roofline_ms"])
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
        if a.tensor_parallel_size > 1 and "decode" in parts and self.device.type == "cuda":
            self.guarded("allreduce", self.allreduce)
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
    parser.add_argument("--out", default=None,
                        help="raw results JSON (default results/engine_speed/<time>.json)")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts among {','.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and sizes (checks every path in seconds, any device)")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    parser.add_argument("--model", default="qwen3-8b", help="shape of decode/prefill/e2e/hf")
    parser.add_argument("--override", action="append", default=[], type=config_override,
                        metavar="KEY=JSON",
                        help="replace a config key of --model (repeatable), e.g. one TP "
                             "rank's shard: num_attention_heads=32 num_key_value_heads=4 "
                             "intermediate_size=12800 for Qwen3-32B at TP=2")
    parser.add_argument("--small-model", default="qwen3-0.6b", help="shape of the small part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks of the large engine (decode's roofline is per GPU, plus "
                             "the measured all-reduces; prefill's rate is the group's)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="the engine's and the measured all-reduces all through NCCL")
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
    # PDSERVE_TRITON_PDL=0 turns PDL off for an A/B, as it does for the servers.
    args.triton_pdl = engine_environment(os.environ)["triton_pdl"]
    results = Bench(args).run()
    out = write_json(args.out or default_out("engine_speed"), results, indent=1)
    print(summarize(results))
    print(f"results in {out}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
