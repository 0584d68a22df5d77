"""The shape of a model, read from an HF config.json; configuration as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_core.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a decoder-only transformer's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool       # Qwen2: q/k/v projections carry a bias
    qk_norm: bool              # Qwen3: RMSNorm on q and k per head
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    mlp_bias: bool = False     # Llama's optional bias on gate/up/down

    @property
    def trained_max_len(self) -> int:
        """The longest context the checkpoint supports, as vLLM derives it: the position
        embeddings, times a RoPE scaling factor (YaRN: of the original length); llama3 and
        longrope already state the extended length."""
        scaling = self.rope_scaling or {}
        if "factor" not in scaling or scaling["rope_type"] in ("llama3", "longrope", "su"):
            return self.max_position_embeddings
        base = self.max_position_embeddings
        if scaling["rope_type"] == "yarn":
            base = int(scaling.get("original_max_position_embeddings", base))
        return int(base * float(scaling["factor"]))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        """Parse a config.json dict; raise ModelLoadError for an unsupported architecture."""
        architectures = config.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {architectures}; supported: {SUPPORTED_ARCHITECTURES}")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            return cls(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(config),
                rope_scaling=_rope_scaling(config),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; its config.json usually does not say so.
                attention_bias=(arch == "Qwen2ForCausalLM"
                                or bool(config.get("attention_bias", False))),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=config.get("torch_dtype") or config.get("dtype"),
                eos_token_ids=token_ids(config.get("eos_token_id")),
                bos_token_id=config.get("bos_token_id"),
                mlp_bias=bool(config.get("mlp_bias", False)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required key {exc}") from None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """KV cache bytes one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size


def token_ids(value: Any) -> tuple[int, ...]:
    """An HF ``eos_token_id`` (one id, a list of them, or absent) as a tuple of ids."""
    if value is None:
        return ()
    return tuple(int(t) for t in value) if isinstance(value, list) else (int(value),)


def _rope_theta(config: dict[str, Any]) -> float:
    """transformers <5 writes top-level ``rope_theta``; 5.x nests it in ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta") or config.get("rope_theta") or 10000.0
    return float(theta)


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling dict with a ``rope_type`` key, or None for plain RoPE.

    Accepts the old ``rope_scaling`` ({"type"|"rope_type", "factor", ...}) and the 5.x
    ``rope_parameters`` ({"rope_type", "rope_theta", ...}) spellings.
    """
    raw = config.get("rope_scaling") or config.get("rope_parameters")
    if not raw:
        return None
    scaling = {k: v for k, v in dict(raw).items() if k not in ("rope_theta", "type")}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings",
                           config.get("max_position_embeddings", 4096))
    return scaling
