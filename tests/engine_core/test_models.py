"""Our Llama / Qwen2 / Qwen3 against HF transformers, through the paged cache."""

from __future__ import annotations

import functools

import pytest
import torch

from engine_core.attention.backend import get_attention_backend
from engine_core.config import ModelConfig
from engine_core.errors import ModelLoadError
from engine_core.layers.rotary import compute_inv_freq
from engine_core.models.registry import get_model_class
from engine_core.models.spec import ModelSpec
from engine_core.worker.loader import load_model, read_model_spec

VARIANTS = ["llama-llama3rope", "qwen2-tied-linear", "qwen3-headdim32"]
BLOCK_SIZE, NUM_BLOCKS = 4, 64
ATOL = 1e-4


@functools.cache
def _models(path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, HF) for one checkpoint, loaded once per process."""
    from transformers import AutoModelForCausalLM

    spec = read_model_spec(path)
    ours = load_model(ModelConfig(model=path), spec, "cpu", torch.float32,
                      get_attention_backend("cpu", "auto"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def _kv_caches(model: torch.nn.Module) -> list[torch.Tensor]:
    spec = model.spec
    return [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, spec.num_key_value_heads, spec.head_dim)
            for _ in range(spec.num_hidden_layers)]


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_prefill_logits_match_hf(variant, model_checkpoint, make_metadata, positions_of) -> None:
    ours, hf = _models(str(model_checkpoint(variant)))
    prompt = _prompt(45, seed=1)   # longer than llama3 scaling's original context (32)
    metadata = make_metadata([45], [0], [list(range(12))], BLOCK_SIZE)
    hidden = ours(prompt, positions_of([45], [0]), metadata, _kv_caches(ours))
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (45, ours.spec.vocab_size)
    torch.testing.assert_close(logits, hf(prompt[None]).logits[0].float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_chunked_prefill_decode_and_batching_match_hf(variant, model_checkpoint, make_metadata,
                                                      positions_of) -> None:
    """Two sequences share steps: A chunked 11+9 then decodes; B joins mid-way."""
    ours, hf = _models(str(model_checkpoint(variant)))
    seq_a, seq_b = _prompt(22, seed=2), _prompt(13, seed=3)
    tables = [[9, 3, 14, 0, 7, 21], [5, 30, 2, 11]]   # scattered blocks
    kv_caches = _kv_caches(ours)
    # (cached, new) per sequence per step; B is absent (0 new) in the first step.
    steps = [([0, 0], [11, 0]), ([11, 0], [9, 13]), ([20, 13], [1, 0]), ([21, 13], [1, 0])]
    ref_a = hf(seq_a[None]).logits[0].float()
    ref_b = hf(seq_b[None]).logits[0].float()
    for cached, new in steps:
        active = [i for i in range(2) if new[i]]
        metadata = make_metadata([new[i] for i in active], [cached[i] for i in active],
                                 [tables[i] for i in active], BLOCK_SIZE)
        ids = torch.cat([(seq_a, seq_b)[i][cached[i]:cached[i] + new[i]] for i in active])
        positions = positions_of([new[i] for i in active], [cached[i] for i in active])
        hidden = ours(ids, positions, metadata, kv_caches)
        last_rows = torch.tensor(metadata.query_start_loc_cpu[1:]) - 1
        logits = ours.compute_logits(hidden[last_rows])
        for row, i in enumerate(active):
            ref = (ref_a, ref_b)[i][cached[i] + new[i] - 1]
            torch.testing.assert_close(logits[row], ref, atol=ATOL, rtol=0)


def test_layer_hooks_called_around_each_layer(model_checkpoint, make_metadata,
                                              positions_of) -> None:
    ours, _ = _models(str(model_checkpoint("qwen3-headdim32")))
    kv_caches = _kv_caches(ours)
    calls: list[tuple[str, int, bool]] = []

    class Hooks:
        def before_layer(self, layer_idx: int) -> None:
            calls.append(("before", layer_idx, False))

        def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
            # The new tokens' K must already sit in the cache (slots 0..4 of block 0/1).
            written = bool(kv_cache[0, 0].abs().sum() > 0)
            calls.append(("after", layer_idx, written and kv_cache is kv_caches[layer_idx]))

    metadata = make_metadata([5], [0], [[0, 1]], BLOCK_SIZE)
    metadata.layer_hooks = Hooks()
    with torch.no_grad():
        ours(_prompt(5, seed=4), positions_of([5], [0]), metadata, kv_caches)
    assert calls == [("before", 0, False), ("after", 0, True),
                     ("before", 1, False), ("after", 1, True)]


def test_tied_lm_head_shares_embedding(model_checkpoint) -> None:
    ours, _ = _models(str(model_checkpoint("qwen2-tied-linear")))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.model.layers[0].self_attn.qkv_proj.bias is not None
    assert ours.model.layers[0].self_attn.o_proj.bias is None


def test_registry_rejects_unknown_architecture() -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ModelLoadError, match="MistralForCausalLM"):
        get_model_class("MistralForCausalLM")


def test_spec_reads_old_and_new_rope_spellings() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 64}
    old = ModelSpec.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "linear", "factor": 2.0}})
    new = ModelSpec.from_hf_config({**base, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    plain = ModelSpec.from_hf_config({**base, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert plain.rope_scaling is None and plain.rope_theta == 1e6


def test_unsupported_rope_type_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="yarn"):
        compute_inv_freq(16, 1e4, {"rope_type": "yarn", "factor": 4.0})
