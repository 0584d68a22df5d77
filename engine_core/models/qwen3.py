"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE, no q/k/v bias by default."""

from __future__ import annotations

from engine_core.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models."""

    qkv_bias_always = False
    o_bias_follows_attention_bias = True
    qk_norm = True
