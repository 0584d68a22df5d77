"""pdserve's engine core: paged-attention LLM engine shared by every worker."""

from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "LLM", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and the models; import it lazily so light users (proxy) stay light.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine_core import llm

        return getattr(llm, name)
    raise AttributeError(name)
