"""Small HF-format checkpoints with fixed-seed random weights and a real BPE tokenizer.

Used by the tests and benchmarks that need a model of a chosen shape, and by
``pdserve serve --demo-random``: everything is built locally (no network) and
deterministically, so every machine gets byte-identical weights. The weights are random,
so the text they produce is noise; the real default model is ``default_model.py``'s.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEMO_VERSION = "1"
RANDOM_DEMO_MODEL_NAME = "pdserve-demo-random"
TOKENIZER_VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few KB of plain English to train the BPE merges on; any change alters token ids,
# so bump DEMO_VERSION with it.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system answers requests from
many users at once, and it must keep the hardware busy while it does so. The prefill
phase reads the whole prompt in one pass and writes the keys and values of every token
into a paged cache. The decode phase then produces one token at a time for each request,
reading the cache again and again. Because the two phases stress the machine in
different ways, a disaggregated system runs them on different workers and moves the
cache between them over a fast link.
Once upon a time there was a small village at the edge of a great forest. The people
of the village were farmers and weavers, and every autumn they gathered in the square
to share bread, apples, cheese and stories. The oldest woman in the village told the
best stories of all: about rivers that ran backwards, mountains that sang at night, and
a clever girl who counted the stars and found that one was missing.
Water boils at one hundred degrees Celsius at sea level. The Earth goes around the Sun
once a year, and the Moon goes around the Earth about once a month. Light from the Sun
takes a little more than eight minutes to reach us. Plants turn sunlight, water and air
into sugar and oxygen; animals breathe the oxygen and eat the plants.
What is the capital of France? The capital of France is Paris. What is two plus two?
Two plus two is four. How are you today? I am fine, thank you, and how are you? Please
write a short poem about the sea. The sea is wide, the sea is deep, it rocks the boats
and sings them to sleep.
In computer science, a hash function maps data of any size to a value of fixed size.
A block of tokens can be named by the hash of its contents and the hash of the block
before it, so that two requests sharing a prefix share the same chain of names. The
scheduler decides which requests run in each step, and the model runner executes that
decision, returning the sampled tokens. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
10, 42, 100, 2024 and 3.14159 appear in text, as do symbols like + - * / = < > ( ) [ ]
{ } # @ % & ! ? : ; , . ' " and new lines.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Good morning! Good afternoon. Good evening, everyone. Thank you very much for coming.
She said that the meeting would start at nine, but nobody arrived before ten. They
walked along the river, talking about books, music, food, travel and the weather.
It was a bright cold day in April, and the clocks were striking thirteen. All happy
families are alike; each unhappy family is unhappy in its own way. It is a truth
universally acknowledged that a single man in possession of a good fortune must be
in want of a wife. Call me Ishmael. The sky above the port was the color of television.
People write in many languages: café, naïve, résumé, über, señor, 世界, こんにちは, 안녕하세요,
Привет, مرحبا, and sometimes with emoji like 🚀 🙂 ✨.
"""


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process (deterministic); later calls reuse it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = _CORPUS.splitlines(keepends=True)
    # Repeat the corpus so pair counts are not all ties (ties are still broken
    # deterministically, but counts > 1 give more natural merges).
    tokenizer.train_from_iterator(lines * 3, trainer=trainer)
    return tokenizer.to_str()


def save_tokenizer(path: Path) -> Any:
    """Write the demo tokenizer (HF fast-tokenizer files, ChatML template) into ``path``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE, model_max_length=1 << 20)
    tokenizer.save_pretrained(str(path))
    return tokenizer


_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def build_checkpoint(path: Path | str, arch: str = "llama", num_layers: int = 2,
                     hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int | None = None, intermediate_size: int = 128,
                     vocab_size: int = 1024, max_position_embeddings: int = 512,
                     tie_word_embeddings: bool = False, seed: int = 0, dtype: str = "float32",
                     shards: int = 1, rope_scaling: dict[str, Any] | None = None,
                     rope_theta: float = 10000.0, initializer_range: float = 0.02) -> Path:
    """Write an HF checkpoint (config, generation config, weights, tokenizer) to ``path``.

    Weights come from HF's own initialisation under ``torch.manual_seed(seed)``, so the
    checkpoint is exactly what ``transformers`` would build, and the same every time.
    """
    import torch  # only to build: a server resolving --demo-random must not import it
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_CONFIG_CLASSES)}, got {arch!r}")
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= the tokenizer's {TOKENIZER_VOCAB_SIZE}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(path)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
    config_class = getattr(transformers, _CONFIG_CLASSES[arch])
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters,
        tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, dtype=dtype)
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard_size = total_bytes // shards + 1 if shards > 1 else "50GB"
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id,
                     do_sample=False).save_pretrained(str(path))
    return path


DEMO_ARGS: dict[str, Any] = {
    "arch": "qwen3", "num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "intermediate_size": 768, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "seed": 1234,
    "rope_theta": 1000000.0, "initializer_range": 0.05,
}


def random_demo_model_path(cache_dir: Path | None = None) -> Path:
    """The random-weight demo model (``DEMO_ARGS``), built on first use and reused afterwards.

    Built in a temporary sibling directory and renamed into place, so concurrent first
    uses (several workers starting at once) never see a half-written checkpoint.
    """
    target = Path(cache_dir) if cache_dir is not None else (
        Path.home() / ".cache" / "pdserve" / f"demo-{DEMO_VERSION}")
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_checkpoint(staging, **DEMO_ARGS)
        (staging / "pdserve_demo.json").write_text(
            json.dumps({"version": DEMO_VERSION, **DEMO_ARGS}, indent=2))
        try:
            os.rename(staging, target)
        except OSError:
            # Another process won the race (target now exists): use theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
