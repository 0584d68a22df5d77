"""The host-share benchmark of constrained steps runs end to end on the CPU, its scripts stay
inside the grammar, and the synthetic vocabulary fills every id."""

from __future__ import annotations

import argparse
from pathlib import Path


def test_synthetic_tokenizer_fills_every_id(tmp_path: Path) -> None:
    from benchmarks.model_shapes import write_model_dir
    from engine_core.hf_tokenizer import load_hf_tokenizer

    write_model_dir("qwen3-0.6b", tmp_path, "bytes", vocab_size=4096)
    tokenizer = load_hf_tokenizer(tmp_path)
    assert len(tokenizer) == 4096
    pieces = [tokenizer.decode([i]) for i in range(4096)]
    assert all(pieces) and tokenizer.convert_tokens_to_ids("<|endoftext|>") == 4093
    assert tokenizer.decode(tokenizer.encode('{"notes": ["a b"]}')) == '{"notes": ["a b"]}'


def test_grammar_host_path_smoke() -> None:
    from benchmarks.grammar_host_path import run

    result = run(argparse.Namespace(tokenizer="bytes", batch_sizes=[1, 3], steps=4))
    for row in result["results"]:
        assert row["advance"] > 0 and row["fill"] > 0
        assert row["plain"]["fill_wait"] == 0.0
        for mode in ("serial", "overlapped"):
            assert row[mode]["fill"] > 0 and row[mode]["step"] > 0
