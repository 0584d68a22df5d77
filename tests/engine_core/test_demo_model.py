"""The demo checkpoint: real tokenizer, chat template, deterministic cached build, speed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_core.attention.backend import get_attention_backend
from engine_core.config import ModelConfig
from engine_core.demo_model import SPECIAL_TOKENS, random_demo_model_path
from engine_core.worker.loader import load_model, read_model_spec


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_demo_model_path(tmp_path_factory.mktemp("cache") / "demo")


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_dir))


@pytest.mark.parametrize("text", ["héllo 世界 🚀", "The quick brown fox.\n\n  def f(x):",
                                  "Привет, مرحبا ✨ naïve café", ""])
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_vocab(tokenizer, demo_dir: Path) -> None:
    spec = read_model_spec(demo_dir)
    assert len(tokenizer) <= spec.vocab_size
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|endoftext|>"
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert tokenizer.eos_token_id in spec.eos_token_ids
    # Common words are single tokens: the merges were really learned.
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1


def test_chat_template(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 🚀<|im_end|>\n<|im_start|>assistant\n")


def test_demo_is_cached_and_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    weights = demo_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert random_demo_model_path(demo_dir) == demo_dir
    assert weights.stat().st_mtime_ns == mtime          # reused, not rebuilt
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left
    rebuilt = random_demo_model_path(tmp_path / "again")
    assert (rebuilt / "model.safetensors").read_bytes() == weights.read_bytes()
    assert (rebuilt / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()


def test_demo_prefill_is_fast(demo_dir: Path, make_metadata, positions_of) -> None:
    spec = read_model_spec(demo_dir)
    assert spec.architecture == "Qwen3ForCausalLM"
    assert load_file(str(demo_dir / "model.safetensors"))  # real weights on disk
    model = load_model(ModelConfig(model=str(demo_dir)), spec, "cpu", torch.float32,
                       get_attention_backend("cpu", "auto"))
    block_size, length = 16, 200
    kv_caches = [torch.zeros(2, 16, block_size, spec.num_key_value_heads, spec.head_dim)
                 for _ in range(spec.num_hidden_layers)]
    metadata = make_metadata([length], [0], [list(range(13))], block_size)
    ids = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, positions_of([length], [0]), metadata, kv_caches)  # warm-up
        start = time.perf_counter()
        logits = model.compute_logits(model(ids, positions_of([length], [0]), metadata,
                                            kv_caches)[-1:])
        elapsed = time.perf_counter() - start
    assert logits.isfinite().all()
    print(f"200-token prefill: {elapsed:.3f}s")
    # Generous bound: CI machines are shared; this guards against pathological slowness only.
    assert elapsed < 10.0, f"200-token prefill took {elapsed:.3f}s"
