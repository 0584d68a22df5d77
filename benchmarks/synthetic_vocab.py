"""A byte-level BPE tokenizer the size of a real model's vocabulary, made of synthetic pieces.

Grammar work scales with the vocabulary's makeup: a mask fill walks the tokens a state may
take, and xgrammar's ``accept_token`` scans the tokenizer's special tokens (every id that
decodes to nothing). A tokenizer much smaller than the logits (the demo tokenizer's 1,000
entries under Qwen3's 151,936 ids leaves 150,936 empty ids) makes each advance cost
~30-90 us instead of ~1-3 us, and each mask nearly free. This vocabulary fills every id with
a piece in roughly a Qwen-like mix: ASCII words with and without a leading space,
punctuation runs (the quotes, braces, commas and colons JSON is made of), digit runs, CJK
characters, whitespace runs, and Qwen's three special tokens at their ids. It has no merges:
text encodes byte by byte, which benchmarks that give prompts as ids do not mind.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

# Qwen's special-token ids (every tokenizer ``model_shapes.py`` writes keeps them).
QWEN_SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PUNCTUATION = "\"':,{}[]().;-_/\\!?#*=+<>@&%$|~`^"


def synthetic_pieces(vocab_size: int, seed: int = 0) -> list[bytes]:
    """``vocab_size`` distinct byte strings: the 256 single bytes, then synthetic pieces
    (the special tokens' ids hold placeholders; ``special_ids`` names them)."""
    rng = random.Random(seed)
    pieces = [bytes([b]) for b in range(256)]
    seen = set(pieces)
    while len(pieces) < vocab_size:
        kind = rng.random()
        if kind < 0.55:
            word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 10)))
            word = word.capitalize() if rng.random() < 0.3 else word
            text = " " + word if rng.random() < 0.5 else word
        elif kind < 0.68:
            text = "".join(rng.choice(_PUNCTUATION) for _ in range(rng.randint(1, 4)))
            text = (" " + text if rng.random() < 0.3 else text) + ("\n" if rng.random() < 0.2
                                                                  else "")
        elif kind < 0.73:
            text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        elif kind < 0.93:
            text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        else:
            text = rng.choice([" ", "\n", "\t", "  "]) * rng.randint(1, 8)
        piece = text.encode()
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return pieces


def special_ids(vocab_size: int) -> dict[int, str]:
    """Qwen's special tokens at their ids; in a smaller vocabulary, its last three ids."""
    if vocab_size > max(QWEN_SPECIAL_TOKENS):
        return dict(QWEN_SPECIAL_TOKENS)
    return {vocab_size - 3 + i: name for i, name in enumerate(QWEN_SPECIAL_TOKENS.values())}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def save_synthetic_tokenizer(path: Path, vocab_size: int) -> Any:
    """Write a byte-level BPE tokenizer of ``vocab_size`` synthetic pieces into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine_core.demo_model import CHATML_TEMPLATE

    alphabet = _byte_to_unicode()
    special = special_ids(vocab_size)
    vocab = {"".join(alphabet[b] for b in piece): i
             for i, piece in enumerate(synthetic_pieces(vocab_size)) if i not in special}
    vocab.update({name: i for i, name in special.items()})
    bpe = Tokenizer(models.BPE(vocab, [], unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE, model_max_length=1 << 20)
    tokenizer.save_pretrained(str(path))
    return tokenizer
