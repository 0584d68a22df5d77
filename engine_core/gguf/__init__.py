"""GGUF checkpoints (llama.cpp's single-file format) as a load format.

A ``.gguf`` file is converted once into an HF-style checkpoint directory in a cache
(``checkpoint.py``): config and generation config from its metadata, the tokenizer through
transformers' GGUF support, and the weights read and dequantized to the serving dtype by
``reader.py``. Everything past the entry points then loads that directory as any other.
"""

from engine_core.gguf.checkpoint import is_gguf_path, resolve_gguf_model

__all__ = ["is_gguf_path", "resolve_gguf_model"]
