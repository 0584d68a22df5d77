"""The tokenizer loader: a plain fast tokenizer is built without the auto machinery (which
imports torch) and equals what AutoTokenizer builds; other classes go through AutoTokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine_core.hf_tokenizer import declared_class, load_hf_tokenizer


def test_plain_fast_tokenizer_loads_without_torch_and_equals_auto(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    assert declared_class(path) == "TokenizersBackend"
    # In a fresh interpreter: loading it must not import torch.
    probe = ("import sys; from engine_core.hf_tokenizer import load_hf_tokenizer; "
             f"t = load_hf_tokenizer({str(path)!r}); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["TokenizersBackend", "False"]

    from transformers import AutoTokenizer

    ours, auto = load_hf_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    text = "the quick brown fox <|im_start|> jumps"
    assert ours.encode(text) == auto.encode(text)
    assert ours.all_special_tokens == auto.all_special_tokens
    assert ours.eos_token_id == auto.eos_token_id and ours.chat_template == auto.chat_template


def test_other_classes_go_through_auto_tokenizer(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert type(load_hf_tokenizer(tmp_path)) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert declared_class(tmp_path / "missing") is None
