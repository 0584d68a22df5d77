"""Llama decoder (also the base of Qwen2 and Qwen3, which differ only in flags).

Parameter names equal the HF checkpoint's tensor names, so loading is a name match.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.attention.backend import AttentionBackend
from engine_core.attention.metadata import AttentionMetadata
from engine_core.layers.activation import SiluAndMul
from engine_core.layers.embedding import LMHead, VocabEmbedding
from engine_core.layers.linear import Linear, MergedLinear, gemv_sized
from engine_core.layers.norm import RMSNorm
from engine_core.layers.rotary import RotaryEmbedding
from engine_core.models.spec import ModelSpec


class LlamaAttention(nn.Module):
    """GQA self-attention: project, (optionally) per-head q/k RMSNorm, RoPE, paged attention."""

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend, layer_idx: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.scale = self.head_dim ** -0.5
        self.attn_backend = attn_backend
        hidden = spec.hidden_size
        kv_size = self.num_kv_heads * self.head_dim
        rows, pdl = attn_backend.gemv_max_rows, attn_backend.pdl
        self.qkv_proj = MergedLinear(hidden, (self.num_heads * self.head_dim, kv_size, kv_size),
                                     ("q_proj", "k_proj", "v_proj"), qkv_bias, rows, pdl)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, o_bias, rows, pdl=pdl)
        self.use_triton = attn_backend.triton_layers
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, self.use_triton, pdl)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, self.use_triton, pdl)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_cache: torch.Tensor | None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # Views into the one qkv output (row stride = its width); the kernels take strides.
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        hooks = attn_metadata.layer_hooks
        if hooks is not None:
            hooks.before_layer(self.layer_idx)
        if (self.use_triton and q.is_cuda and kv_cache is not None
                and attn_metadata.max_query_len == 1):
            out = self._decode_from_projections(q, k, v, cos, sin, attn_metadata, kv_cache)
        else:
            q, k = self._norm_and_rotate(q, k, cos, sin)
            out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        if hooks is not None and kv_cache is not None:
            hooks.after_layer(self.layer_idx, kv_cache)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _decode_from_projections(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cos: torch.Tensor, sin: torch.Tensor,
                                 attn_metadata: AttentionMetadata,
                                 kv_cache: torch.Tensor) -> torch.Tensor:
        """Decode-only step on the Triton path: the attention kernel norms and rotates q and
        the new k and writes the new K/V itself (two launches a layer fewer)."""
        from engine_core.kernels.paged_decode import NewTokenRope

        q_norm, k_norm = self.q_norm, self.k_norm
        norms = ((q_norm.weight, k_norm.weight, q_norm.eps)
                 if q_norm is not None and k_norm is not None else ())
        rope = NewTokenRope(k, v, cos, sin, attn_metadata.slot_mapping, *norms)
        return self.attn_backend.forward_decode(q, rope, kv_cache, attn_metadata, self.scale)

    def _norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k RMSNorm (Qwen3) then RoPE: one fused kernel on the Triton path."""
        q_norm, k_norm = self.q_norm, self.k_norm
        if self.use_triton and q.is_cuda:
            from engine_core.kernels.rotary import apply_rope

            pdl = self.attn_backend.pdl
            if q_norm is None or k_norm is None:
                return apply_rope(q, k, cos, sin, pdl=pdl)
            return apply_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps, pdl=pdl)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``.

    On the Triton path with ``split_k_mlp`` (``--split-k-mlp``), without biases and with
    weights the GEMV takes, the down weight is
    stored transposed and the GEMV's rows run split-K (``kernels/split_k_mlp.py``),
    returning the float32 sums: the caller gives a zeroed accumulator (``takes_split_k``)
    and the next norm rounds it.
    """

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden, inter = spec.hidden_size, spec.intermediate_size
        rows, self.pdl = attn_backend.gemv_max_rows, attn_backend.pdl
        self.gate_up_proj = MergedLinear(hidden, (inter, inter), ("gate_proj", "up_proj"),
                                         spec.mlp_bias, rows, self.pdl)
        self.split_k = (attn_backend.triton_layers and attn_backend.split_k_mlp
                        and not spec.mlp_bias
                        and self.gate_up_proj.gemv_max_rows > 0
                        and gemv_sized(inter, hidden))
        self.down_proj = Linear(inter, hidden, spec.mlp_bias, rows, transposed=self.split_k,
                                pdl=self.pdl)
        self.act_fn = SiluAndMul(attn_backend.triton_layers, self.pdl)

    def takes_split_k(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` of rows shaped as ``x`` sums into a float32 accumulator
        (shapes, dtype and device only: a CUDA graph records one choice)."""
        return self.split_k and self.gate_up_proj.takes_gemv(x)

    def forward(self, x: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of ``x``; with ``acc`` (zeroed float32 ``[T, hidden]``, when
        ``takes_split_k``) the sums are added there and ``acc`` returned: up to
        ``SPLIT_K_MAX_ROWS`` rows by the one split-K launch, more by gate/up's GEMV and
        the split-K GEMV over the transposed down weight."""
        gate_up = self.gate_up_proj
        if acc is not None:
            from engine_core.kernels.gemv import gemv
            from engine_core.kernels.split_k_mlp import (
                SPLIT_K_MAX_ROWS,
                split_k_gemv_t,
                split_k_mlp,
            )

            down_t = self.down_proj.weight.t()
            if x.shape[0] <= SPLIT_K_MAX_ROWS:
                return split_k_mlp(x, gate_up.weight, down_t, acc, down_transposed=True,
                                   pdl=self.pdl)
            return split_k_gemv_t(gemv(x, gate_up.weight, silu_mul=True, pdl=self.pdl), down_t,
                                  acc, pdl=self.pdl)
        if self.act_fn.use_triton and gate_up.takes_gemv(x):
            # SiLU * up in the GEMV's epilogue (the same roundings as the separate kernel):
            # one launch and the [T, 2 * I] round trip less per layer at decode.
            from engine_core.kernels.gemv import gemv

            return self.down_proj(gemv(x, gate_up.weight, gate_up.bias, silu_mul=True,
                                       pdl=self.pdl))
        return self.down_proj(self.act_fn(gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The residual stream is carried apart from the block output so that each residual add
    fuses with the norm that follows it (``add_and_norm``); the sums and their rounding
    are the same as ``x + f(norm(x))``. The block output may be the split-K MLP's float32
    sums (``LlamaMLP``), which the next norm rounds where the down projection would.
    """

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend, layer_idx: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        use_triton, pdl = attn_backend.triton_layers, attn_backend.pdl
        self.self_attn = LlamaAttention(spec, attn_backend, layer_idx, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(spec, attn_backend)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, use_triton, pdl)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, use_triton,
                                                pdl)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream); the first layer gets ``residual=None``."""
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, attn_metadata, kv_cache)
        acc = (torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
               if self.mlp.takes_split_k(hidden) else None)
        normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, acc)
        return self.mlp(normed, acc), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, attn_backend, i, qkv_bias, o_bias, qk_norm)
            for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, attn_backend.triton_layers,
                            attn_backend.pdl)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                                          attn_backend.triton_layers, attn_backend.pdl)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata, kv_cache)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The model contract: ``forward`` -> hidden ``[T, hidden]``; ``compute_logits`` -> float32."""

    # Bias layout and q/k norm are what distinguishes the families built on this class.
    qkv_bias_always = False
    o_bias_follows_attention_bias = True
    qk_norm = False

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        qkv_bias = self.qkv_bias_always or spec.attention_bias
        o_bias = self.o_bias_follows_attention_bias and spec.attention_bias
        self.model = LlamaModel(spec, attn_backend, qkv_bias, o_bias, self.qk_norm)
        self.lm_head = LMHead(spec.vocab_size, spec.hidden_size, attn_backend.gemv_max_rows,
                              attn_backend.pdl)
        if spec.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` float32 for the hidden rows that need sampling."""
        return self.lm_head(hidden)
