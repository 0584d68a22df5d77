"""pdserve's engine core: paged-attention LLM engine shared by every worker."""

from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "LLM"]


def __getattr__(name: str):
    # LLM pulls in torch and the models; import it lazily so light users (proxy) stay light.
    if name == "LLM":
        from engine_core.llm import LLM

        return LLM
    raise AttributeError(name)
