"""Config-only model directories with real model shapes, for ``--load-format dummy``.

No model hub is reachable from the benchmark machines, so benchmarks describe a model by
its HF ``config.json`` (the published shapes) plus the demo tokenizer, and the engine fills
the weights with random values. The model's vocabulary is the real one; the tokenizer only
knows the demo's 1000 entries, so prompts are given as token ids or as demo-tokenizer text,
and generated ids past the tokenizer decode to nothing (benchmarks use ``ignore_eos``).

``--tokenizer bytes`` writes a byte-level BPE vocabulary of the model's size made of synthetic
pieces in a Qwen-like mix (``benchmarks/synthetic_vocab.py``): grammar benchmarks use it, since
masks and grammar advances cost what they cost with a real vocabulary only on one.

``--tokenizer words`` writes instead a word-level tokenizer covering the whole vocabulary
(token ``i`` is the word ``t{i}``; Qwen's special tokens keep their ids): every id a dummy
model samples then decodes to visible text, so streamed responses carry content and a
serving benchmark can time the first token, and decode-then-encode gives back the same ids.

    python3 -m benchmarks.model_shapes qwen3-8b /tmp/qwen3-8b [--tokenizer words|bytes]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.synthetic_vocab import save_synthetic_tokenizer, special_ids
from engine_core.demo_model import CHATML_TEMPLATE, save_tokenizer

TOKENIZERS = ("demo", "words", "bytes")

# Published shapes: config.json of Qwen/Qwen3-0.6B, -8B and -32B, and of
# meta-llama/Llama-3.1-70B (its keys replace the Qwen3 defaults in ``_COMMON``). The two
# large ones need several GPUs (``--tensor-parallel-size``).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False},
    "qwen3-32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "tie_word_embeddings": False},
    "llama-3.1-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                      "rope_theta": 500000.0, "mlp_bias": False,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}},
}
_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0,
}


def save_word_tokenizer(path: Path, vocab_size: int) -> Any:
    """A word-level tokenizer whose ``vocab_size`` ids are the words ``t{i}`` (and specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special_ids(vocab_size)
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in special}
    vocab.update({name: i for i, name in special.items()})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE, model_max_length=1 << 20)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def config_override(text: str) -> tuple[str, Any]:
    """``KEY=JSON`` (a command-line override of one config key) as ``(key, value)``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{key}: {value!r} is not JSON ({exc})") from None


def write_model_dir(shape: str, path: Path | str, tokenizer: str = "demo",
                    **overrides: Any) -> Path:
    """Write ``config.json`` and a tokenizer (``demo``, ``words`` or ``bytes``) for ``shape``
    into ``path``.

    ``overrides`` replace config keys (a smaller ``vocab_size`` for CPU tests, say).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**_COMMON, **SHAPES[shape], **overrides}
    if tokenizer == "words":
        saved = save_word_tokenizer(path, config["vocab_size"])
    elif tokenizer == "bytes":
        saved = save_synthetic_tokenizer(path, config["vocab_size"])
    else:
        saved = save_tokenizer(path)
    eos_id = saved.convert_tokens_to_ids("<|endoftext|>")
    config.update(eos_token_id=eos_id, pad_token_id=eos_id)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="demo",
                        help="demo: the demo BPE (1000 ids); words: one word per vocabulary id; "
                        "bytes: synthetic byte-level pieces, one per vocabulary id")
    args = parser.parse_args()
    print(write_model_dir(args.shape, args.path, args.tokenizer))


if __name__ == "__main__":
    main()
