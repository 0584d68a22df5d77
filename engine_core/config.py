"""Frozen engine configuration, built once at the edge (CLI or ``LLM(...)``) and passed in.

Nothing below the entry points reads environment variables; every knob lives here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine_core.addresses import is_host_port, route_source_host
from engine_core.cluster.trust import ClusterSecret
from engine_core.dtypes import DTYPE_ALIASES
from engine_core.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
HASH_ALGOS = ("sha256", "xxhash")
DTYPES = ("auto", *DTYPE_ALIASES)  # --dtype choices
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SEND_TYPES = ("PUT", "PUT_ASYNC", "GET")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
ATTENTION_BACKENDS = ("auto", "triton", "torch_ref")
# The generation-config keys applied as request defaults (vLLM's, less max_new_tokens: a cap
# on every request's max_tokens that needs the prompt's length to apply as vLLM does).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM's cudagraph_mode values we support (lower case): graphs of every step kind, or of
# decode-only steps.
CUDA_GRAPH_MODES = ("full", "full_decode_only")
# The decode MLP's split-K kernels (kernels/split_k_mlp.py): auto takes them on the GPUs
# they were measured faster on.
SPLIT_K_MLP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how to load it."""

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    # Allow sleep(level) / wake_up(): free the GPU's weights and KV cache while idle (as
    # vLLM's --enable-sleep-mode; engine_core/worker/sleep.py).
    enable_sleep_mode: bool = False
    # vLLM's --generation-config: where generation_config.json's sampling defaults come from
    # ("auto": the model's folder; "vllm": none; else a folder). Its eos ids stop requests
    # in every mode (models/generation_config.py).
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling defaults set over the loaded ones.
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # Where a GGUF model is converted to safetensors once (None: ~/.cache/pdserve/gguf).
    gguf_cache_dir: str | None = None
    # A --max-model-len past the model's trained length is refused unless this is set (as
    # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): positions past it give garbage, not errors.
    allow_long_max_model_len: bool = False

    def __post_init__(self) -> None:
        if not self.generation_config:
            raise ConfigError('--generation-config must be "auto", "vllm" or a folder')
        if not isinstance(self.override_generation_config, dict):
            raise ConfigError("--override-generation-config must be a JSON object")
        unknown = sorted(set(self.override_generation_config) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"--override-generation-config: unsupported keys {unknown}; "
                              f"supported: {list(GENERATION_CONFIG_KEYS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be >= 1")

    @property
    def name(self) -> str:
        """The model name clients use (``--served-model-name`` or the path)."""
        return self.served_model_name or self.model

    @property
    def tokenizer_path(self) -> str:
        """Where the HF tokenizer is loaded from (``--tokenizer`` or the model's folder)."""
        return self.tokenizer or self.model


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache size and prefix-caching policy."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # Cluster-wide seed of the block-hash chain: prefill, decode and proxy must agree.
    prefix_hash_seed: str = "pdserve-v1"
    kv_cache_dtype: str = "auto"
    # KV offload (vLLM's --kv-offloading-size, GiB): host memory that keeps cached blocks the
    # device evicts, so a later prefix hit copies them back instead of recomputing; 0 = off.
    kv_offloading_size: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_offloading_size < 0:
            raise ConfigError("--kv-offloading-size must be >= 0 (GiB)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("--num-gpu-blocks-override must be >= 2")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before reading step N's sampled tokens (fed to N+1 on
    # the device), so the host's work overlaps the GPU's. False: one step at a time.
    async_scheduling: bool = True
    # A step that carries decodes takes at most the prompt tokens that keep it within this
    # many seconds (engine_core/step_rates.py), at least a block: its streams' TPOT holds
    # while prefills progress in chunks. None: such a step fills the token budget.
    decode_step_target_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be >= 1")
        target = self.decode_step_target_s
        if target is not None:
            if not 0 < target < math.inf:
                raise ConfigError("--decode-step-target-ms must be a finite number > 0")
            if not self.enable_chunked_prefill:
                raise ConfigError("--decode-step-target-ms needs chunked prefill: it splits "
                                  "prompts into chunks that fit beside the decodes")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs: ``auto`` picks CUDA when present, else CPU."""

    device: str = "auto"
    # True: never capture CUDA graphs (every step runs eagerly), as vLLM's flag.
    enforce_eager: bool = False
    # auto: Triton kernels on CUDA when available, else the torch reference.
    attention_backend: str = "auto"
    # Step sizes (tokens) captured as CUDA graphs. Empty: the default schedules (decode up to
    # min(max_num_seqs, 512), mixed steps up to min(max_num_batched_tokens, 2048)); one
    # value: those schedules up to the value; several: exactly those.
    cuda_graph_sizes: tuple[int, ...] = ()
    # full: decode-only and mixed steps replay graphs; full_decode_only: decode-only steps.
    cuda_graph_mode: str = "full"
    # Projections of at most this many rows use the Triton GEMV (Triton path, 16-bit
    # weights). None: the backend's measured default; 0: always cuBLAS.
    triton_gemv_max_rows: int | None = None
    # The decode MLP split-K with the down weight stored transposed (Triton path): auto on
    # the GPUs where it measured faster (kernels/split_k_mlp.py), on, or off.
    split_k_mlp: str = "auto"
    # Launch the decode step's Triton kernels with programmatic dependent launch where the GPU
    # has it (kernels/pdl.py); off under PDSERVE_TRITON_PDL=0 and the Triton interpreter.
    triton_pdl: bool = True

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, "
                              f"got {self.attention_backend!r}")
        if self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ConfigError(f"--cuda-graph-mode must be one of {CUDA_GRAPH_MODES}, "
                              f"got {self.cuda_graph_mode!r}")
        sizes = tuple(int(s) for s in (self.cuda_graph_sizes or ()))
        if any(s < 1 for s in sizes):
            raise ConfigError(f"--cuda-graph-sizes must be positive, got {list(sizes)}")
        object.__setattr__(self, "cuda_graph_sizes", sizes)  # lists from LLM(...) kwargs
        if self.split_k_mlp not in SPLIT_K_MLP_MODES:
            raise ConfigError(f"--split-k-mlp must be one of {SPLIT_K_MLP_MODES}, "
                              f"got {self.split_k_mlp!r}")
        rows = self.triton_gemv_max_rows
        if rows is not None and not 0 <= rows <= 16:
            raise ConfigError(f"--triton-gemv-max-rows must be within 0..16, got {rows}")

    def resolve(self) -> str:
        """The concrete torch device string."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def address_list(value: Any, key: str) -> tuple[str, ...]:
    """HOST:PORT addresses from a JSON list or a comma-separated string."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or any(not isinstance(a, str) for a in items):
        raise ConfigError(f"{key} must be a list of HOST:PORT strings or a comma-separated "
                          "string of them")
    addresses = tuple(a.strip() for a in items if a.strip())
    bad = [a for a in addresses if not is_host_port(a)]
    if bad:
        raise ConfigError(f"{key} must be HOST:PORT each, got {bad[:3]}")
    return addresses


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model and which one this process is.

    Rank 0 is the engine process (scheduler, sampler, outputs); it spawns ranks 1..N-1 and
    fills ``distributed_init_method`` (the process group's rendezvous) before they start.
    """

    tensor_parallel_size: int = 1
    rank: int = 0
    distributed_init_method: str | None = None
    # vLLM's flag: every all-reduce through NCCL, none through peer memory.
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be >= 1")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(f"tensor-parallel rank {self.rank} is outside "
                              f"[0, {self.tensor_parallel_size})")

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel_size > 1


def _as_int(value: Any, key: str) -> int:
    """vLLM's seed examples pass numbers as strings ("21001", "1e1"); accept both."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv-transfer-config: {key} must be a number, got {value!r}") from None
    if number != int(number):
        raise ConfigError(f"kv-transfer-config: {key} must be a whole number, got {value!r}")
    return int(number)


def _as_float(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv-transfer-config: {key} must be a number, got {value!r}") from None


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config``: vLLM's JSON keys, with values normalised to their types."""

    kv_connector: str = "P2pNcclConnector"
    kv_role: str = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    # vLLM's P2P connector reads this as GB of GPU receive buffer ("1e1" = 10 GB).
    kv_buffer_size: float = 1e9
    # The KV socket's address, bound and advertised to the proxy. Not given in the JSON (as in
    # vLLM's examples, where the engine uses the host's own address), it is the address this
    # host reaches the proxy from: 127.0.0.1 told a proxy on another host an unreachable one.
    kv_ip: str = "127.0.0.1"
    kv_ip_given: bool = True  # False: derived from the proxy's address (re-derived with it)
    kv_port: int = 14579
    proxy_ip: str | None = None
    proxy_port: int | None = None
    # Further proxies this worker registers with (HOST:PORT each; extra-config key
    # ``proxy_addresses``, a list or a comma-separated string): several proxies serve one
    # cluster, and one's death cuts only its own streams.
    proxy_addresses: tuple[str, ...] = ()
    http_ip: str | None = None
    http_port: int | None = None
    send_type: str = "PUT_ASYNC"
    nccl_num_channels: int | None = None
    # Data calls carry at least this many bytes (consecutive layers grouped): see
    # connectors/p2p_nccl/messages.py plan_layers_per_call. 0 = one call per layer.
    min_call_bytes: int = 32 << 20
    kv_load_failure_policy: str = "recompute"
    # Below the proxy's first-byte deadline (30 s by default): a decode worker whose prefill
    # worker died gives up the load and computes the prompt itself while the proxy still
    # waits for the stream's first byte.
    transfer_timeout_s: float = 15.0
    get_lease_s: float = 60.0
    orphan_ttl_s: float = 60.0
    transport: str = "auto"  # auto | nccl | cpu
    extra: dict[str, Any] = field(default_factory=dict)
    # Seals KV control messages and verifies transfer grants. Not in the JSON: the worker's
    # entry point reads it from --cluster-secret-file.
    cluster_secret: ClusterSecret = ClusterSecret()

    def __post_init__(self) -> None:
        if self.kv_connector not in ("P2pNcclConnector", "PdserveConnector"):
            raise ConfigError(
                f"kv_connector {self.kv_connector!r} is not supported (use P2pNcclConnector)")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.send_type not in SEND_TYPES:
            raise ConfigError(f"send_type must be one of {SEND_TYPES}, got {self.send_type!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}")
        if self.transport not in ("auto", "nccl", "cpu"):
            raise ConfigError("transport must be auto, nccl or cpu")
        if not 0 < self.kv_port < 65536:
            raise ConfigError(f"kv_port out of range: {self.kv_port}")
        if self.min_call_bytes < 0:
            raise ConfigError("min_call_bytes must be >= 0")
        if self.nccl_num_channels is not None and not 1 <= self.nccl_num_channels <= 64:
            raise ConfigError(f"nccl_num_channels must be in [1, 64], got {self.nccl_num_channels}")
        bad = [a for a in self.proxy_addresses if not is_host_port(a)]
        if bad:
            raise ConfigError(f"proxy_addresses must be HOST:PORT each, got {bad[:3]}")

    @property
    def registration_addresses(self) -> tuple[str, ...]:
        """Every proxy this worker heartbeats to: proxy_ip:proxy_port, then the others."""
        first = (() if self.proxy_ip is None or self.proxy_port is None
                 else (f"{self.proxy_ip}:{self.proxy_port}",))
        return tuple(dict.fromkeys((*first, *self.proxy_addresses)))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def kv_buffer_bytes(self) -> int:
        """Receive-buffer bound in bytes: values under 1e4 are GB (vLLM's convention)."""
        if self.kv_buffer_size < 1e4:
            return int(self.kv_buffer_size * 1e9)
        return int(self.kv_buffer_size)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> KVTransferConfig:
        """Parse vLLM-style JSON; unknown top-level keys are an error, extra-config keys kept."""
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-transfer-config must be a JSON object")
        extra = data.pop("kv_connector_extra_config", {}) or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        known_top = {"kv_connector", "kv_role", "kv_rank", "kv_parallel_size",
                     "kv_buffer_size", "kv_ip", "kv_port", "kv_buffer_device",
                     "kv_load_failure_policy", "engine_id", "kv_connector_module_path"}
        unknown = set(data) - known_top
        if unknown:
            raise ConfigError(f"--kv-transfer-config: unknown keys {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for key in ("kv_connector", "kv_role", "kv_ip", "kv_load_failure_policy"):
            if key in data:
                kwargs[key] = str(data[key])
        for key in ("kv_rank", "kv_parallel_size", "kv_port"):
            if data.get(key) is not None:
                kwargs[key] = _as_int(data[key], key)
        if "kv_buffer_size" in data:
            kwargs["kv_buffer_size"] = _as_float(data["kv_buffer_size"], "kv_buffer_size")
        for key in ("proxy_ip", "http_ip", "send_type", "transport"):
            if key in extra:
                kwargs[key] = str(extra[key])
        for key in ("proxy_port", "http_port", "nccl_num_channels", "min_call_bytes"):
            if extra.get(key) is not None:
                kwargs[key] = _as_int(extra[key], key)
        if extra.get("proxy_addresses") is not None:
            kwargs["proxy_addresses"] = address_list(extra["proxy_addresses"], "proxy_addresses")
        for key in ("transfer_timeout_s", "get_lease_s", "orphan_ttl_s"):
            if key in extra:
                kwargs[key] = _as_float(extra[key], key)
        if "kv_load_failure_policy" in extra:
            kwargs["kv_load_failure_policy"] = str(extra["kv_load_failure_policy"])
        if "kv_ip" not in data:
            kwargs["kv_ip_given"] = False
            if kwargs.get("proxy_ip"):
                kwargs["kv_ip"] = route_source_host(kwargs["proxy_ip"])
        kwargs["extra"] = dict(extra)
        return cls(**kwargs)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine-core needs; the single object passed down from the edge."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    kv_transfer: KVTransferConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def with_changes(self, **sections: Any) -> EngineConfig:
        """A copy with whole sections replaced (configs are frozen)."""
        return replace(self, **sections)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword names (``max_num_seqs=...``), as ``LLM`` takes them."""
        sections: dict[str, dict[str, Any]] = {"model": {"model": model}, "cache": {},
                                               "scheduler": {}, "device": {},
                                               "parallel": {}}
        owners = {
            "model": ModelConfig, "cache": CacheConfig,
            "scheduler": SchedulerConfig, "device": DeviceConfig, "parallel": ParallelConfig,
        }
        kv_transfer = kwargs.pop("kv_transfer_config", None)
        for key, value in kwargs.items():
            for section, klass in owners.items():
                if key in {f.name for f in fields(klass)}:
                    sections[section][key] = value
                    break
            else:
                raise ConfigError(f"unknown engine argument {key!r}")
        if isinstance(kv_transfer, (str, dict)):
            kv_transfer = KVTransferConfig.from_json(kv_transfer)
        return cls(
            model=ModelConfig(**sections["model"]),
            cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**sections["scheduler"]),
            device=DeviceConfig(**sections["device"]),
            kv_transfer=kv_transfer,
            parallel=ParallelConfig(**sections["parallel"]),
        )
