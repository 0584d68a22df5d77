"""Loading a checkpoint's Hugging Face tokenizer, in one place.

A checkpoint whose ``tokenizer_config.json`` names the plain fast-tokenizer class
(``TokenizersBackend``, or ``PreTrainedTokenizerFast``) gets that class directly: the same
object ``AutoTokenizer`` would build, without the auto machinery, which imports torch and
costs a server about 3.5 s of CPU at every start. Every other class (model-specific
tokenizers, remote code) goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declared_class(path: str | Path) -> str | None:
    """The ``tokenizer_class`` a checkpoint directory declares (None: none or unreadable)."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def load_hf_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the checkpoint at ``path``, as ``AutoTokenizer`` would load it."""
    import transformers

    name = declared_class(path)
    if (not trust_remote_code and name in PLAIN_FAST_CLASSES
            and (Path(path) / "tokenizer.json").is_file() and hasattr(transformers, name)):
        return getattr(transformers, name).from_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path),
                                                      trust_remote_code=trust_remote_code)
