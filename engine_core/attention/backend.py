"""The one attention interface every backend implements, and backend selection."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.errors import ConfigError

logger = logging.getLogger("pdserve.attention")


@dataclass(frozen=True)
class AttentionShapes:
    """One model's attention shapes, as the backend's kernels see them."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class AttentionPlan:
    """A backend's kernel choices the runner's step inputs follow: the prefill work list's
    unit (tokens a tile; 0: the kernels read no list) and the decode work list's size."""

    prefill_tile_tokens: int = 0
    # Work items a mixed step's decode rows share (attention/decode_work.py); 0: no list.
    decode_work_target: int = 0
    # Greedy sampling's argmax by the Triton kernel (kernels/argmax.py) on CUDA.
    triton_sampling: bool = False
    # The Triton kernels launch with PDL where the GPU has it (DeviceConfig.triton_pdl).
    triton_pdl: bool = False


class AttentionBackend(ABC):
    """Paged attention: store this step's K/V in the cache, then attend over the cache.

    ``kv_cache`` is one layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    tensor (0 = K, 1 = V); its dtype may differ from q's (fp8 cache): values are cast on
    write and cast back on read. ``kv_cache=None`` (a profiling run with no cache yet)
    attends over the new tokens only, which requires every sequence to be a full prefill.
    """

    name: str = "abstract"
    # Whether the model should use the fused Triton RMSNorm / RoPE kernels as well.
    triton_layers: bool = False
    # Projections of at most this many rows (16-bit weights) run the Triton GEMV; 0: cuBLAS.
    gemv_max_rows: int = 0
    # The model's MLP runs split-K at decode (kernels/split_k_mlp.py; Triton path only).
    split_k_mlp: bool = False
    # The Triton kernels launch with PDL where the GPU has it (kernels/pdl.py).
    pdl: bool = False

    def plan(self, shapes: AttentionShapes) -> AttentionPlan:
        """What the runner must know of this backend's kernels for one model."""
        return AttentionPlan()

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> attention output ``[T, Hq, D]``."""


def get_attention_backend(device: str, kv_cache_dtype: str | torch.dtype | None = None,
                          name: str = "auto",
                          gemv_max_rows: int | None = None,
                          split_k_mlp: str = "auto", pdl: bool = True) -> AttentionBackend:
    """Pick the backend for ``--attention-backend`` (auto | triton | torch_ref).

    ``auto`` takes Triton on CUDA when triton is installed and the GPU can run the cache
    dtype, else the torch reference (which runs everywhere and defines correct results).
    ``triton`` where it cannot run is a ConfigError rather than a silent fallback.
    ``gemv_max_rows`` (``--triton-gemv-max-rows``; None: the Triton backend's default)
    applies to the Triton path only, as does ``split_k_mlp`` (``--split-k-mlp``: auto, on,
    off; auto asks ``kernels/split_k_mlp.split_k_mlp_pays`` for the device), as does ``pdl``
    (``DeviceConfig.triton_pdl``).
    """
    from engine_core.attention.torch_ref import TorchRefAttentionBackend

    if name == "torch_ref":
        return TorchRefAttentionBackend()
    problem = _triton_problem(device, kv_cache_dtype)
    if problem is None:
        from engine_core.attention.triton_backend import TritonAttentionBackend
        from engine_core.kernels.split_k_mlp import split_k_mlp_pays

        split_k = split_k_mlp == "on" or (split_k_mlp == "auto"
                                          and split_k_mlp_pays(torch.device(device)))
        return TritonAttentionBackend(gemv_max_rows=gemv_max_rows, split_k_mlp=split_k,
                                      pdl=pdl)
    if name == "triton":
        raise ConfigError(f"--attention-backend triton: {problem}")
    if torch.device(device).type == "cuda":
        logger.warning("attention backend torch_ref: %s", problem)
    return TorchRefAttentionBackend()


def _triton_problem(device: str, kv_cache_dtype: str | torch.dtype | None) -> str | None:
    """Why the Triton backend cannot run here, or None when it can."""
    from engine_core.kernels import triton_available

    torch_device = torch.device(device)
    if torch_device.type != "cuda":
        return f"needs a CUDA device, not {device!r}"
    if not triton_available():
        return "triton is not installed"
    if kv_cache_dtype in (torch.float8_e4m3fn, "fp8", "fp8_e4m3"):
        capability = torch.cuda.get_device_capability(torch_device)
        if capability < (8, 9):
            return f"an fp8 e4m3 cache needs compute capability 8.9+, this GPU has {capability}"
    return None
