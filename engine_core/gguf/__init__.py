"""GGUF checkpoints (llama.cpp's single-file format) as a load format.

A ``.gguf`` file is converted once into an HF-style checkpoint directory in a cache
(``checkpoint.py``): config and generation config from its metadata, the tokenizer through
transformers' GGUF support, and the weights read and dequantized to the serving dtype by
``reader.py``. Everything past the entry points then loads that directory as any other.
"""


from __future__ import annotations

import os

from engine_core.config import EngineConfig


def is_gguf_path(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix, as vLLM decides)."""
    return str(model).lower().endswith(".gguf")


def resolve_gguf_model(config: EngineConfig) -> EngineConfig:
    """``config`` with a GGUF model replaced by its converted directory (converted now if
    not cached); the served name stays the file's as given. Other configs come back as is.
    Torch is imported only to convert (a cache miss): a server's API process serving a
    checkpoint directory, or a GGUF file converted before, never loads it."""
    if not is_gguf_path(config.model.model):
        return config
    from engine_core.gguf.checkpoint import converted_config

    return converted_config(config)


__all__ = ["is_gguf_path", "resolve_gguf_model"]
