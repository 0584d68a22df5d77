"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from engine_core.errors import ModelLoadError
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.qwen2 import Qwen2ForCausalLM
from engine_core.models.qwen3 import Qwen3ForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; ModelLoadError when we have none."""
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {sorted(_MODEL_CLASSES)}"
        ) from None
