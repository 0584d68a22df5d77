"""Qwen2: Llama with biases on q/k/v (never on o_proj)."""

from __future__ import annotations

from engine_core.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 dense models."""

    qkv_bias_always = True
    o_bias_follows_attention_bias = False
    qk_norm = False
