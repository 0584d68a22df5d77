"""Model dtypes by name, without torch.

A server's API process resolves ``--dtype`` (a GGUF file's cache entry is named by it)
before it spawns the engine, and must not import torch to do so: that costs every start
over a second of CPU. The engine turns the name into a ``torch.dtype``
(``worker.loader.resolve_dtype``).
"""

from __future__ import annotations

from engine_core.errors import ModelLoadError

# --dtype spellings -> the canonical name (a ``torch`` attribute).
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_HALF = ("float16", "bfloat16")


def resolve_dtype_name(dtype: str, checkpoint_dtype: str | None, device: str) -> str:
    """The parameter dtype's canonical name: an explicit ``--dtype`` wins; ``auto`` follows
    the checkpoint.

    Like vLLM, ``auto`` uses the checkpoint's dtype (float32 when it names none), except on
    CPU, where half-precision checkpoints run in float32: CPU half matmuls are slow and
    have no fused kernels, and float32 makes outputs match the HF reference.
    """
    if dtype != "auto":
        if dtype not in DTYPE_ALIASES:
            raise ModelLoadError(f"unknown dtype {dtype!r}")
        return DTYPE_ALIASES[dtype]
    resolved = DTYPE_ALIASES.get(str(checkpoint_dtype).removeprefix("torch."), "float32")
    if device.startswith("cpu") and resolved in _HALF:
        return "float32"
    return resolved
