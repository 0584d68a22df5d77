"""Config-only model directories with real model shapes, for ``--load-format dummy``.

No model hub is reachable from the benchmark machines, so benchmarks describe a model by
its HF ``config.json`` (the published shapes) plus the demo tokenizer, and the engine fills
the weights with random values. The model's vocabulary is the real one; the tokenizer only
knows the demo's 1000 entries, so prompts are given as token ids or as demo-tokenizer text,
and generated ids past the tokenizer decode to nothing (benchmarks use ``ignore_eos``).

    python3 -m benchmarks.model_shapes qwen3-8b /tmp/qwen3-8b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine_core.demo_model import save_tokenizer

# Published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False},
}
_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0,
}


def write_model_dir(shape: str, path: Path | str) -> Path:
    """Write ``config.json`` and the demo tokenizer for ``shape`` into ``path``."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(path)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = {**_COMMON, **SHAPES[shape], "eos_token_id": eos_id, "pad_token_id": eos_id}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    args = parser.parse_args()
    print(write_model_dir(args.shape, args.path))


if __name__ == "__main__":
    main()
