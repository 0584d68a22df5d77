"""Read a GGUF file: its metadata as an HF ``config.json`` dict and its tensors under HF
names, dequantized to float32 (``gguf`` package), for the Llama, Qwen2 and Qwen3 families."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine_core.errors import ModelLoadError

# general.architecture -> the HF architecture our model registry serves.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# "<arch>.<key>" metadata -> config.json key.
_CONFIG_KEYS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# GGUF tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Read into config.json's rope_scaling (llama3_rope_scaling), never a parameter.
_IGNORED_TENSORS = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (clear errors for a missing package or bad file)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf"
                             ) from None

    class _PlainArrayReader(GGUFReader):
        """Parses through a plain ndarray view of the memory map: numpy's memmap subclass
        costs a Python hook per slice, and a tokenizer's metadata is ~10^5 slices."""

        def _get(self, offset: int, dtype: Any, count: int = 1,
                 override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            item = np.dtype(dtype)
            count = int(count)
            array = plain[offset:offset + item.itemsize * count].view(item)[:count]
            order = self.byte_order if override_order is None else override_order
            return array.view(array.dtype.newbyteorder(order))

    try:
        return _PlainArrayReader(path)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None


def metadata_value(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata field's value (scalars, strings and arrays as Python values)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any) -> str:
    """The file's ``general.architecture``, checked against the families we serve."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: "
                             f"{sorted(ARCHITECTURES)}")
    return arch


def hf_config(reader: Any, dtype_name: str) -> dict[str, Any]:
    """The ``config.json`` the file's metadata describes, with ``dtype_name`` as its dtype."""
    arch = architecture(reader)
    config: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]],
                              "model_type": _MODEL_TYPES[arch], "torch_dtype": dtype_name}
    for key, hf_key in _CONFIG_KEYS.items():
        value = metadata_value(reader, f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    if "vocab_size" not in config:  # the embedding's rows (the token list may be shorter)
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        config["vocab_size"] = int(embedding.shape[-1])
    scaling = metadata_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": metadata_value(reader, f"{arch}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": metadata_value(
                reader, f"{arch}.rope.scaling.original_context_length",
                config.get("max_position_embeddings"))}
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        config["rope_scaling"] = llama3_rope_scaling(np.asarray(rope_freqs.data), config)
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
    for name in ("bos", "eos", "padding"):
        token_id = metadata_value(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = token_id
    return config


def llama3_rope_scaling(freq_factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """The HF ``rope_scaling`` behind llama.cpp's ``rope_freqs`` tensor (per-frequency
    divisors it bakes in for Llama 3.1+): Llama 3's schedule with the released models'
    constants, checked against every divisor; other schedules are refused."""
    import torch

    from engine_core.layers.rotary import compute_inv_freq

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = float(config.get("rope_theta", 10000.0))
    scaling = {"rope_type": "llama3", "factor": float(freq_factors.max()),
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    implied = compute_inv_freq(head_dim, theta, None) / compute_inv_freq(head_dim, theta, scaling)
    if not torch.allclose(implied, torch.from_numpy(freq_factors.astype(np.float32)), rtol=1e-4):
        raise ModelLoadError("this GGUF file's rope_freqs tensor is not Llama 3's RoPE "
                             "scaling; it is not supported")
    return scaling


def stop_token_ids(reader: Any) -> list[int]:
    """The ids that end a turn: eos, and the end-of-turn/-message ids chat models add."""
    ids = [metadata_value(reader, f"tokenizer.ggml.{name}_token_id")
           for name in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor; None for tensors the models do not use."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_TENSORS:
            raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no HF counterpart")
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_TENSORS:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no HF counterpart")
    return f"{_GLOBAL_TENSORS[base]}.{kind}"


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation of Llama attention weights (and biases).

    Its converter reorders each head's rows from HF's half-split RoPE layout (first half
    of the dims, then second) to interleaved pairs; reading back needs the inverse.
    """
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def iter_hf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor the model uses as (HF name, float32 array in HF's layout)."""
    from gguf import dequantize

    is_llama = architecture(reader) == "llama"
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r}: {exc}") from None
        part = tensor.name.split(".")[-2]
        if is_llama and part in heads:
            values = unpermute_rotary(values, heads[part])
        yield name, values
